"""``kvhal size MODEL``: a model's KV bytes per token from its Hugging Face ``config.json``, and
what that makes of a workload on each tier (docs/sizing.md explains the choices).

The KV of one token is, for attention with separate keys and values,
``2 x num_hidden_layers x num_key_value_heads x head_dim x the KV dtype's bytes``; for multi-head
latent attention (DeepSeek V2/V3: ``kv_lora_rank`` in the config), one latent per layer of
``kv_lora_rank + qk_rope_head_dim`` values. With tensor parallelism each rank holds its share
of the KV heads (vLLM replicates a head where there are fewer heads than ranks) and the whole
latent (MLA's is not split): the sizes below are an engine's, all its ranks together.

Each tier keeps whole blocks (``block_size`` tokens) of one rank per slot, and kvhal stores
full blocks only: a context's last partial block is recomputed. A host slot is the block's
bytes; a disk slot rounds them up to 4 KiB and adds a 64-byte record
(:class:`kvhal.tiers.disk.format.Geometry`); a store value adds a 96-byte header
(:data:`kvhal.tiers.remote.format.HEADER_BYTES`).

Models whose layers do not all keep every token (sliding windows, hybrid attention and
Mamba layers) keep less than this: the sizes are an upper bound for them.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pydantic import ByteSize, TypeAdapter
from pydantic import ValidationError as PydanticError

from kvhal.errors import ValidationError
from kvhal.tiers.disk.format import RECORD_BYTES, Geometry
from kvhal.tiers.remote.format import HEADER_BYTES

__all__ = ["KVShape", "TierSize", "add_arguments", "kv_shape", "read_config", "run", "size_tiers"]

#: Bytes of one value of each KV dtype (``torch_dtype``, or vLLM's ``--kv-cache-dtype``).
DTYPE_BYTES = {
    "float32": 4,
    "float": 4,
    "bfloat16": 2,
    "float16": 2,
    "half": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}
#: vLLM's default tokens per KV block (``--block-size``).
BLOCK_SIZE = 16
_SIZE = TypeAdapter(ByteSize)


@dataclass(frozen=True)
class KVShape:
    """What one token's KV is made of, for one model."""

    architecture: str
    layers: int
    kv_heads: int  # 0 for MLA
    head_dim: int  # for MLA: kv_lora_rank + qk_rope_head_dim
    dtype: str
    mla: bool

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def rank_bytes_per_token(self, tensor_parallel: int = 1) -> int:
        """One rank's KV bytes per token."""
        if self.mla:  # one latent per layer, on every rank
            return self.layers * self.head_dim * self.dtype_bytes
        heads = max(1, self.kv_heads // tensor_parallel)
        return 2 * self.layers * heads * self.head_dim * self.dtype_bytes

    def describe(self) -> str:
        if self.mla:
            return f"{self.layers} layers x a {self.head_dim}-value latent (MLA), {self.dtype}"
        heads = f"{self.kv_heads} KV heads x {self.head_dim} head_dim"
        return f"{self.layers} layers x {heads} x 2 (K, V), {self.dtype}"


def read_config(path: str | Path) -> dict[str, Any]:
    """A model's ``config.json``: ``path`` is the file, or the model's directory holding it.

    :raises ValidationError: no such file, or not a JSON object.
    """
    file = Path(path)
    if file.is_dir():
        file = file / "config.json"
    try:
        config = json.loads(file.read_text())
    except FileNotFoundError:
        raise ValidationError(
            "MODEL", f"{file} does not exist: give a model's directory or its config.json"
        ) from None
    except (OSError, ValueError) as exc:
        raise ValidationError("MODEL", f"{file} cannot be read as JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ValidationError("MODEL", f"{file} is not a JSON object")
    return config


def _int(config: dict[str, Any], name: str) -> int:
    value = config.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValidationError("MODEL", f"config.json's {name} is {value!r}, not a positive integer")
    return value


def kv_shape(config: dict[str, Any], kv_dtype: str | None = None) -> KVShape:
    """The KV shape of a Hugging Face ``config`` (its ``text_config`` for a multimodal model).

    :param kv_dtype: the KV cache's dtype where it is not the model's (vLLM's ``--kv-cache-dtype fp8``).
    :raises ValidationError: a field it needs is missing, or the dtype is unknown.
    """
    text = config.get("text_config")
    if "num_hidden_layers" not in config and isinstance(text, dict):
        config = {
            **text,
            "architectures": config.get("architectures"),
            "torch_dtype": config.get("torch_dtype"),
        }
    dtype = kv_dtype or config.get("torch_dtype") or config.get("dtype") or "bfloat16"
    dtype = str(dtype).removeprefix("torch.")
    if dtype not in DTYPE_BYTES:
        raise ValidationError(
            "kv-dtype", f"{dtype!r} is not a KV dtype kvhal knows: {', '.join(DTYPE_BYTES)}"
        )
    architecture = (config.get("architectures") or [config.get("model_type", "?")])[0]
    layers = _int(config, "num_hidden_layers")
    if config.get("kv_lora_rank"):
        latent = _int(config, "kv_lora_rank") + _int(config, "qk_rope_head_dim")
        return KVShape(architecture, layers, 0, latent, dtype, True)
    heads = _int(config, "num_attention_heads")
    kv_heads = _int(config, "num_key_value_heads") if config.get("num_key_value_heads") else heads
    head_dim = _int(config, "head_dim") if config.get("head_dim") else _int(config, "hidden_size") // heads
    return KVShape(architecture, layers, kv_heads, head_dim, dtype, False)


@dataclass(frozen=True)
class TierSize:
    """One tier's sizes for the workload: bytes a block takes there (all ranks), the budget for
    every user's context, and, for a given budget, the blocks and users it holds."""

    tier: str
    block_bytes: int
    budget_for_all: int
    given: int | None = None
    blocks_held: int | None = None
    users_held: int | None = None


def size_tiers(
    shape: KVShape,
    *,
    block_size: int = BLOCK_SIZE,
    tensor_parallel: int = 1,
    tokens_per_user: int,
    users: int,
    given: dict[str, int | None] | None = None,
) -> tuple[int, list[TierSize]]:
    """``(blocks of one user's context, each tier's sizes)`` for ``users`` contexts of
    ``tokens_per_user`` tokens; ``given`` maps a tier (``host``, ``disk``, ``store``) to a budget."""
    slot = block_size * shape.rank_bytes_per_token(tensor_parallel)  # one rank's block
    blocks = tokens_per_user // block_size  # full blocks only: the last partial one is recomputed
    disk_slot = Geometry.plan(slot, 0).stride + RECORD_BYTES
    per_block = {
        "host": slot * tensor_parallel,
        "disk": disk_slot * tensor_parallel,
        "store": (slot + HEADER_BYTES) * tensor_parallel,
    }
    rows = []
    for tier, block_bytes in per_block.items():
        budget = (given or {}).get(tier)
        held = None if budget is None else budget // block_bytes
        rows.append(
            TierSize(
                tier,
                block_bytes,
                block_bytes * blocks * users,
                budget,
                held,
                None if held is None else (held // blocks if blocks else 0),
            )
        )
    return blocks, rows


def human(n: int | float) -> str:
    """``n`` bytes in binary units (``1.50 GiB``)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError


def _size(text: str) -> int:
    try:
        return int(_SIZE.validate_python(text))
    except PydanticError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: {exc.errors()[0]['msg']}") from None


def _positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text} is not positive")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="a model's directory (its config.json) or a config.json")
    parser.add_argument("--tokens-per-user", type=_positive, default=4096, help="one user's context (4096)")
    parser.add_argument("--users", type=_positive, default=100, help="users whose contexts to keep (100)")
    parser.add_argument("--block-size", type=_positive, default=BLOCK_SIZE, help="vLLM's block size (16)")
    parser.add_argument("--tensor-parallel-size", "--tp", type=_positive, default=1, dest="tensor_parallel")
    parser.add_argument("--kv-dtype", help="the KV cache's dtype if not the model's (fp8, bfloat16, ...)")
    for tier, what in (("host", "cpu_bytes_to_use"), ("disk", "disk_bytes_to_use"), ("store", "the store's")):
        parser.add_argument(
            f"--{tier}", type=_size, help=f"a budget ({what}, e.g. 64GiB): the users it holds"
        )
    parser.add_argument("--json", action="store_true", help="print JSON")


def run(args: argparse.Namespace) -> int:
    """Print the sizes; 1 with the reason for a config it cannot read."""
    try:
        shape = kv_shape(read_config(args.model), args.kv_dtype)
    except ValidationError as exc:
        print(f"kvhal size: {exc}")
        return 1
    tp = args.tensor_parallel
    blocks, rows = size_tiers(
        shape,
        block_size=args.block_size,
        tensor_parallel=tp,
        tokens_per_user=args.tokens_per_user,
        users=args.users,
        given={"host": args.host, "disk": args.disk, "store": args.store},
    )
    token = shape.rank_bytes_per_token(tp) * tp
    if args.json:
        report = {
            "shape": asdict(shape),
            "kv_bytes_per_token": token,
            "kv_bytes_per_block": token * args.block_size,
            "blocks_per_user": blocks,
            "tiers": [asdict(r) for r in rows],
        }
        print(json.dumps(report, indent=1))
        return 0
    print(f"{args.model}: {shape.architecture}, {shape.describe()}")
    ranks = f" ({human(token // tp)} on each of {tp} ranks)" if tp > 1 else ""
    print(f"KV per token: {token} bytes ({human(token)}){ranks}")
    print(f"KV per block of {args.block_size} tokens: {human(token * args.block_size)}")
    print(
        f"one user's context of {args.tokens_per_user} tokens: {blocks} full blocks, "
        f"{human(token * args.block_size * blocks)} (the last partial block is recomputed)"
    )
    print(
        f"{'tier':6} {'per block':>12} {f'all {args.users} users':>16} {'budget':>12} {'users it holds':>15}"
    )
    for r in rows:
        given = "" if r.given is None else human(r.given)
        held = "" if r.users_held is None else str(r.users_held)
        print(f"{r.tier:6} {human(r.block_bytes):>12} {human(r.budget_for_all):>16} {given:>12} {held:>15}")
    print("host: cpu_bytes_to_use (per engine); disk: disk_bytes_to_use; store: the fleet's (docs/sizing.md)")
    return 0
