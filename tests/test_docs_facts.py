"""What the docs name exists, and what they quote from the code is what the code says.

test_public_imports.py imports every name the docs' code blocks show. This checks the rest of
what a newcomer follows, in README.md, BENCHMARKS.md, conformance/README.md, the plugins'
READMEs and docs/*.md:

- files: a path in backticks or a link that is kvhal's (under a top-level entry of the
  repository, a path inside a package, a test file) exists; none points outside the
  repository (``../``);
- tests: ``test_file.py::test_name`` names a test defined in that file;
- modules: a dotted ``kvhal...`` name imports (or is an attribute of what imports);
- configuration keys: the keys of ``kv_connector_extra_config`` the docs name (its tables,
  the dicts of its examples, ``kv_connector_extra_config.KEY``) are keys the connector takes
  (:func:`configuration_keys`);
- numbers: a default in a key table, a key or constant quoted with its value
  (`` `remote_lookup_timeout_ms` (200 ms) ``, `` `SHUTDOWN_WAIT_S` (10 s) ``), and a
  requirement's lower bound (``torch>=2.4``) equal the code's.

Each check is a function of a doc's text; the negative controls plant a stale name in a
real doc and require the check to fail.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import importlib.util
import re
import subprocess
from dataclasses import MISSING, fields
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted(
    [
        ROOT / "README.md",
        ROOT / "BENCHMARKS.md",
        ROOT / "conformance" / "README.md",
        *(ROOT / "plugins").glob("*/README.md"),
        *(ROOT / "docs").glob("*.md"),
    ]
)


# -- what the code says: the one place each check reads it ---------------------------------


def configuration_keys() -> frozenset[str]:
    """The keys ``kv_connector_extra_config`` takes: ``kvhal.vllm.config.KNOWN_KEYS`` (the
    declaration of the keys re-exports it there)."""
    from kvhal.vllm.config import KNOWN_KEYS

    return frozenset(KNOWN_KEYS)


def configuration_defaults() -> dict[str, object]:
    """The defaults the docs quote, by key, from the configuration's dataclasses."""
    from kvhal.vllm.config import LowerTierConfig, RemoteTierConfig

    remote = {f"remote_{f.name}": f.default for f in fields(RemoteTierConfig) if f.default is not MISSING}
    lower = {f.name: f.default for f in fields(LowerTierConfig)}
    return {
        **{key: remote[key] for key in configuration_keys() if key in remote},
        "lower_tier_wait_ms": lower["wait_ms"],
        "lower_tier_wait_policy": lower["wait_policy"],
    }


@cache
def files() -> tuple[str, ...]:
    """Every file of the working tree git does not ignore (tracked or new), relative paths."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split("\n")
    return tuple(path for path in listed if path and (ROOT / path).exists())


@cache
def directories() -> frozenset[str]:
    return frozenset(str(parent) for path in files() for parent in Path(path).parents if str(parent) != ".")


@cache
def top_level() -> frozenset[str]:
    return frozenset(path.split("/")[0] for path in files())


@cache
def code_constants() -> dict[str, object]:
    """Module-level ``NAME = literal`` of kvhal's and its plugins' sources (a name defined twice
    with two values is left out: the docs cannot quote it unambiguously)."""
    found: dict[str, set[object]] = {}
    for path in files():
        if not path.endswith(".py") or not (path.startswith("src/") or "/src/" in path):
            continue
        for node in ast.parse((ROOT / path).read_text()).body:
            target = node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None
            if isinstance(node, ast.AnnAssign):
                target = node.target
            if isinstance(target, ast.Name) and target.id.isupper() and node.value is not None:
                with contextlib.suppress(ValueError, TypeError, SyntaxError):  # not a literal
                    found.setdefault(target.id, set()).add(ast.literal_eval(node.value))
    return {name: next(iter(values)) for name, values in found.items() if len(values) == 1}


@cache
def code_names() -> frozenset[str]:
    """What kvhal's, its plugins' and the suite's sources define or quote: ``def NAME``,
    ``NAME =`` and ``"dotted.name"`` (hooks, fixtures, entry-point groups)."""
    names: set[str] = set()
    for path in files():
        if path.endswith(".py") and not path.startswith("tests/"):
            text = (ROOT / path).read_text()
            names |= set(re.findall(r"^\s*(?:async\s+)?def\s+(\w+)", text, re.M))
            names |= set(re.findall(r"^(\w+)\s*[:=]", text, re.M))
            names |= set(re.findall(r"[\"']([\w.]+)[\"']", text))
    return frozenset(names)


@cache
def requirements() -> dict[str, str]:
    """``{distribution: lower bound}`` of kvhal's requirements (``torch>=2.4`` -> ``2.4``)."""
    # [project]'s dependencies (read as text: tomllib is Python 3.11's, kvhal takes 3.10)
    listed = re.search(r"^dependencies = \[(.*?)^\]", (ROOT / "pyproject.toml").read_text(), re.M | re.S)
    assert listed, "pyproject.toml: no dependencies list"
    bounds = {}
    for requirement in re.findall(r'^\s*"([^"]+)"', listed[1], re.M):
        match = re.fullmatch(r"([\w-]+)\s*>=\s*([\w.]+)", requirement.split(";")[0].strip())
        if match:
            bounds[match[1]] = match[2]
    return bounds


# -- what the docs say ----------------------------------------------------------------------

CODE_BLOCK = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)
BACKTICKED = re.compile(r"`([^`\s]+)`")
LINK = re.compile(r"\]\(([^)\s]+)\)")
#: file name extensions of what the docs point to in the repository
EXTENSIONS = (".py", ".md", ".sh", ".toml", ".json", ".png", ".c", ".txt", ".yml", ".tmpl")
TEST_REFERENCE = re.compile(r"^(?:(?P<dir>[\w./]*?)/?)?(?P<file>test_\w+\.py)?::(?P<test>\w+(?:\.\.\.)?)$")
TEST_FILE = re.compile(r"^(?:(?P<dir>[\w./]*?)/)?(?P<file>test_\w+\.py)$")
#: Other projects' files the docs cite by a path of their own (vLLM, torch_npu, vllm-ascend):
#: not kvhal's, so not looked for here.
FOREIGN = {
    "cuda_mem_ops.py",
    "gpu_worker.py",
    "kv_offload/shmem_host.py",
    "rocm_segmented_attn.py",
    "swap_blocks_triton.py",
    "torch_npu/npu/streams.py",
    "ultraquant_attn.py",
    "vllm_ascend/worker/model_runner_v1.py",
    "worker/v2/attn_utils.py",
}
#: Bare file names looked for anywhere in the tree (other names, ``meta.json``, are what kvhal writes).
SOURCE_EXTENSIONS = (".py", ".c", ".sh", ".tmpl")
#: Module names the docs show that are not kvhal's to import: the vendor guide's example plugin.
NOT_INSTALLED = ("kvhal_acme",)


@cache
def vendor_package() -> frozenset[str]:
    """The files of the package ``kvhal new-plugin`` writes (the vendor guide names them)."""
    from kvhal.scaffold import FILES

    return frozenset(FILES.values())


def prose(text: str) -> str:
    """``text`` without its fenced code blocks."""
    return CODE_BLOCK.sub("", text)


def expand(token: str) -> list[str]:
    """``a.{json,png}`` -> ``a.json``, ``a.png``."""
    match = re.search(r"\{([^{}]*)\}", token)
    if not match:
        return [token]
    return [
        p
        for part in match[1].split(",")
        for p in expand(token[: match.start()] + part + token[match.end() :])
    ]


def defines_test(test: str, in_files: list[str]) -> bool:
    prefix = test.endswith("...")
    name = test.removesuffix("...")
    end = "" if prefix else r"\b"
    pattern = re.compile(rf"^\s*(?:async\s+)?def\s+{re.escape(name)}{end}", re.M)
    return any(pattern.search((ROOT / path).read_text()) for path in in_files)


def candidate_test_files(directory: str | None, name: str | None) -> list[str]:
    """The test files a reference may mean: by its name and the directories before it."""
    candidates = [p for p in files() if p.endswith(".py") and "test" in p]
    if name:
        candidates = [p for p in candidates if Path(p).name == name]
    if directory:
        directory = directory.replace("...", "").strip("/")
        candidates = [p for p in candidates if f"/{directory}/" in f"/{p}" or p.startswith(f"{directory}/")]
    return candidates


def path_problems(text: str, where: str) -> list[str]:
    """Files and tests ``text`` names that do not exist, and paths out of the repository."""
    problems = []
    tokens = [(t, "backticks") for t in BACKTICKED.findall(text)] + [(t, "link") for t in LINK.findall(text)]
    for token, how in tokens:
        if how == "link":
            if re.match(r"^(https?:|mailto:|#)", token):
                continue
            token = token.split("#")[0]
            base = (ROOT / where).parent
            target = (base / token).resolve()
            if not target.is_relative_to(ROOT):
                problems.append(f"{where}: link {token} points outside the repository")
            elif not target.exists():
                problems.append(f"{where}: link {token} names no file")
            continue
        if token.startswith("../"):
            problems.append(f"{where}: {token} is outside the repository")
            continue
        reference = TEST_REFERENCE.match(token)
        if reference:
            candidates = candidate_test_files(reference["dir"], reference["file"])
            if not candidates:
                problems.append(f"{where}: {token}: no such test file")
            elif not defines_test(reference["test"], candidates):
                problems.append(f"{where}: {token}: no such test in {', '.join(candidates)}")
            continue
        if ":" in token or "..." in token or "<" in token or token.startswith("/") or token in FOREIGN:
            continue  # file:line and repo:path citations of other projects, placeholders, absolute paths
        if any(part.split(".")[0].isupper() for part in token.split("/")) or token in vendor_package():
            continue  # DIR/NAME.json; a file of the package `kvhal new-plugin` writes
        test_file = TEST_FILE.match(token)
        if test_file:
            if not candidate_test_files(test_file["dir"], test_file["file"]):
                problems.append(f"{where}: {token}: no such test file")
            continue
        for path in expand(token):
            first = path.split("/")[0]
            if ("/" in path.rstrip("/") and first in top_level()) or path in top_level():
                if not (ROOT / path).exists():
                    problems.append(f"{where}: {path} does not exist")
            elif (
                path.endswith(SOURCE_EXTENSIONS)
                and re.fullmatch(r"[\w./-]+", path)
                # a module or file by its name or its path inside a package: anywhere in the tree
                and not any(f == path or f.endswith("/" + path) for f in files())
            ):
                problems.append(f"{where}: {path}: no such file in the repository")
    return problems


MODULE = re.compile(r"^(kvhal\w*(?:\.\w+)+|kvhal_\w+)")


def resolves(name: str) -> bool:
    """Whether dotted ``name`` imports, or is an attribute of what imports."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for attribute in parts[cut:]:
                found = getattr(found, attribute)
        except AttributeError:
            return False
        return True
    return False


def module_problems(text: str, where: str) -> list[str]:
    """``kvhal...`` names in backticks that neither import, nor are an attribute of what
    imports, nor are defined or quoted in the code (a hook, a fixture, an entry-point group)."""
    problems = []
    for token in BACKTICKED.findall(prose(text)):
        match = MODULE.match(token)
        if not match or match[1].startswith(NOT_INSTALLED):
            continue
        name = match[1]
        if resolves(name) or name in code_names():
            continue
        first = name.split(".")[0]
        if first in code_names() and importlib.util.find_spec(first) is None:
            continue  # an attribute of a fixture (``kvhal_device.create_stream``)
        problems.append(f"{where}: {name} neither imports nor is defined in the code")
    return problems


KEY_TABLE_HEADER = re.compile(r"^\|\s*key\s*\|(.*)\|\s*$", re.I | re.M)
EXTRA_CONFIG_DICT = re.compile(r"kv_connector_extra_config[\"']?\s*[:=]\s*\{")
DOTTED_KEY = re.compile(r"kv_connector_extra_config\.(\w+)")
QUOTED_KEY = re.compile(r"[\"'](\w+)[\"']\s*:")


GENERATED = re.compile(r"<!--[^>]*generated[^>]*-->.*?<!-- end of the generated[^>]*-->", re.S)


def key_tables(text: str) -> list[tuple[str, str | None]]:
    """``(key, documented default or None)`` of each row of the tables headed ``| Key | ... |``
    (not in a generated reference: the test of its generator keeps it true)."""
    text = GENERATED.sub("", text)
    rows = []
    for header in KEY_TABLE_HEADER.finditer(text):
        columns = ["key", *(c.strip().lower() for c in header[1].split("|"))]
        default_at = columns.index("default") if "default" in columns else None
        for line in text[header.end() :].lstrip("\n").splitlines()[1:]:  # past the |---| line
            if not line.startswith("|"):
                break
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            key = re.match(r"`(\w+)", cells[0])
            if key:
                rows.append((key[1], cells[default_at] if default_at is not None else None))
    return rows


def extra_config_dicts(text: str) -> list[str]:
    """The top-level keys of every ``kv_connector_extra_config: {...}`` the text shows."""
    keys = []
    for start in EXTRA_CONFIG_DICT.finditer(text):
        depth, at = 1, start.end()
        body = []
        while at < len(text) and depth:
            char = text[at]
            depth += {"{": 1, "}": -1}.get(char, 0)
            body.append(char if depth == 1 else " ")  # nested dicts' keys are not the connector's
            at += 1
        keys += QUOTED_KEY.findall("".join(body))
    return keys


def named_keys(text: str) -> list[str]:
    """Every configuration key ``text`` names: its key tables, its examples' dicts, and
    ``kv_connector_extra_config.KEY``."""
    return [key for key, _ in key_tables(text)] + extra_config_dicts(text) + DOTTED_KEY.findall(text)


def key_problems(text: str, where: str) -> list[str]:
    known = configuration_keys()
    return [
        f"{where}: configuration key {key!r} does not exist" for key in named_keys(text) if key not in known
    ]


QUOTED_VALUE = re.compile(r"`(\w+)` \((?:default:? )?(\d[\d,_]*(?:\.\d+)?(?: ?(?:ms|s)\b)?)")
REQUIREMENT = re.compile(r"\b([\w-]+)>=(\d[\w.]*)")


def same(documented: str, value: object, name: str = "") -> bool:
    """Whether a documented value (``200``, ``"auto"``, ``(none)``, ``5 s``) is ``value``,
    read in the unit ``name`` ends with (``_ms``, ``_s``)."""
    documented = documented.strip().strip("`").strip('"').replace(",", "").replace("_", "")
    if value is None:
        return documented.lower() in ("null", "none", "(none)")
    if isinstance(value, bool):
        return documented.lower() == str(value).lower()
    if isinstance(value, (int, float)):
        number = re.match(r"(-?\d+(?:\.\d+)?)\s*(ms|s)?\b", documented)
        if number is None:
            return False
        quoted, unit = float(number[1]), number[2]
        if unit == "s" and name.lower().endswith("_ms"):
            quoted *= 1000
        elif unit == "ms" and name.lower().endswith("_s"):
            quoted /= 1000
        return quoted == float(value)
    return documented == str(value)


def number_problems(text: str, where: str) -> list[str]:
    """Defaults, constants and requirement bounds the text quotes that differ from the code's."""
    problems = []
    defaults, constants = configuration_defaults(), code_constants()
    for key, documented in key_tables(text):
        if documented is not None and key in defaults and not same(documented, defaults[key], key):
            problems.append(f"{where}: {key}'s default is {defaults[key]!r}, the doc says {documented}")
    for name, documented in QUOTED_VALUE.findall(text):
        if name in defaults:
            value = defaults[name]
        elif name.isupper():
            if name not in constants:
                problems.append(f"{where}: {name} ({documented}) is no constant of the code")
                continue
            value = constants[name]
        else:
            continue
        if not same(documented, value, name):
            problems.append(f"{where}: `{name}` is {value!r} in the code, the doc says {documented}")
    for distribution, bound in REQUIREMENT.findall(prose(text)):
        if distribution in requirements() and requirements()[distribution] != bound:
            problems.append(
                f"{where}: {distribution}>={bound}, pyproject.toml requires >={requirements()[distribution]}"
            )
    return problems


def problems(text: str, where: str) -> list[str]:
    return [
        *path_problems(text, where),
        *module_problems(text, where),
        *key_problems(text, where),
        *number_problems(text, where),
    ]


# -- the docs -------------------------------------------------------------------------------


def where(doc: Path) -> str:
    return doc.relative_to(ROOT).as_posix()


@pytest.mark.parametrize("doc", DOCS, ids=where)
def test_what_the_doc_names_exists_and_what_it_quotes_is_the_codes(doc: Path) -> None:
    found = problems(doc.read_text(), where(doc))
    assert not found, "\n".join(found)


def test_the_scans_find_what_they_check() -> None:
    # a doc rewritten in another form must not empty the checks: each finds what it looks for
    texts = {where(doc): doc.read_text() for doc in DOCS}
    keys = {key for text in texts.values() for key in named_keys(text)}
    assert {"cpu_bytes_to_use", "disk_path", "remote_url", "remote_lookup_timeout_ms"} <= keys
    quoted = {name for text in texts.values() for name, _ in QUOTED_VALUE.findall(text)}
    assert {"remote_lookup_timeout_ms", "remote_load_timeout_ms", "SHUTDOWN_WAIT_S"} <= quoted
    tables = {key for text in texts.values() for key, default in key_tables(text) if default}
    assert {"remote_lookup_timeout_ms", "remote_load_timeout_ms", "lower_tier_wait_ms"} <= tables
    paths = sum(len(BACKTICKED.findall(text)) for text in texts.values())
    assert paths > 500
    assert any(REQUIREMENT.search(prose(text)) for text in texts.values())


def test_every_configuration_key_is_documented() -> None:
    documented = {key for doc in DOCS for key in named_keys(doc.read_text())}
    documented |= {t for doc in DOCS for t in BACKTICKED.findall(doc.read_text())}
    assert configuration_keys() - documented == set()


# -- negative controls: a stale name planted in a real doc fails the check ---------------------

TIERS = ROOT / "docs" / "tiers.md"
KEY_TABLE = "\n| Key | Default | Meaning |\n|---|---|---|\n| `{key}` | `{default}` | x |\n"


@pytest.mark.parametrize(
    ("planted", "says"),
    [
        (
            KEY_TABLE.format(key="remote_lookup_timeout", default=200),
            "'remote_lookup_timeout' does not exist",
        ),
        (KEY_TABLE.format(key="remote_lookup_timeout_ms", default=250), "the doc says `250`"),
        (KEY_TABLE.format(key="lower_tier_wait_ms", default=100), "the doc says `100`"),
        (
            '```python\n"kv_connector_extra_config": {"disk_dir": "/x", "tier_options": {"path": 1}}\n```',
            "'disk_dir'",
        ),
        ("set `kv_connector_extra_config.cpu_bytes`", "'cpu_bytes' does not exist"),
        ("waits `SHUTDOWN_WAIT_S` (30 s)", "the doc says 30"),
        ("waits `SHUTDOWN_WAITING_S` (10 s)", "no constant of the code"),
        ("at most `remote_load_timeout_ms` (4 s)", "the doc says 4 s"),
        ("kvhal requires torch>=2.1", "torch>=2.1"),
        ("`test_disk_tier.py::test_gone`", "no such test in tests/test_disk_tier.py"),
        ("`e2e/...::test_gone`", "no such test in tests/e2e/"),
        ("`tests/test_disk_tiers.py`", "no such test file"),
        ("`src/kvhal/tiers/chains.py`", "src/kvhal/tiers/chains.py does not exist"),
        ("`tiers/chains.py`", "tiers/chains.py: no such file"),
        ("`kvhal.tiers.medium`", "kvhal.tiers.medium neither imports"),
        ("`kvhal.tiers.media.no_such_name`", "kvhal.tiers.media.no_such_name neither imports"),
        ("`kvhal_no_such_hook`", "kvhal_no_such_hook neither imports"),
        ("[x](../../shared/docs/x.md)", "outside the repository"),
        ("[x](no-such.md)", "names no file"),
        ("`../shared/docs/vllm-cpu.md`", "outside the repository"),
    ],
)
def test_a_stale_name_planted_in_a_doc_fails_the_check(planted: str, says: str) -> None:
    text = TIERS.read_text()
    assert problems(text, "docs/tiers.md") == []  # the control: the doc as it is passes
    found = problems(f"{text}\n{planted}\n", "docs/tiers.md")
    assert any(says in problem for problem in found), found


def test_what_exists_is_not_reported() -> None:
    fine = (
        "`tests/e2e/test_vllm_connector.py`, `tiers/stores/redis.py`, `kvhal.tiers.media`, "
        "`kvhal_copy_blocks`, `kvhal.plugins`, `test_disk_tier.py::test_symlink_path_refused`, "
        "`remote_load_timeout_ms` (5 s), `remote_lookup_timeout_ms` (200 ms), `SHUTDOWN_WAIT_S` (10 s), "
        "[tiers](tiers.md)"
    )
    assert problems(fine, "docs/x.md") == []
