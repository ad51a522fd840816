"""How many ``HEAD`` s, in how many round trips, an S3 lookup of ``kvhal bench chat``'s returning
turns asks (:func:`kvhal.tiers.remote.runs.held_blocks`), with no server: the store is the set of
names the engines would have written. Each turn stores what it computed, from its hit on: the
runs its store job holds whole as one name each, every other block (a prompt's last partial
run, the answer's blocks) alone. Run it on two commits to compare their searches
(docs/tiers.md, "Object size and count").

    .venv/bin/python scripts/probes/s3_lookup_names.py [--users 16] [--rounds 4] [--run-blocks 8]
"""

from __future__ import annotations

import argparse
import statistics

from kvhal.bench.chat.workload import BLOCK, workload
from kvhal.tiers.remote.runs import held_blocks, pieces


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--users", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--run-blocks", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    k = args.run_blocks
    work = workload(args.users, args.rounds, (1024, 2048), 100, 32000, 0)
    heads, rounds = [], []
    for user, context in enumerate(work["contexts"]):
        stored: set[tuple[bool, int]] = set()
        history = len(context)
        for r in range(args.rounds):
            prompt = history + len(work["turns"][r][user])
            count = (prompt - 1) // BLOCK  # a lookup stops short of the last token
            hit = 0
            if r > 0:
                batches: list[int] = []

                def exists(
                    units: list[tuple[bool, int]], batches: list[int] = batches, stored: set = stored
                ) -> list[bool]:
                    batches.append(len(units))
                    return [unit in stored for unit in units]

                hit = held_blocks(count, pieces(list(range(count)), k, tails=True), exists)
                heads.append(sum(batches))
                rounds.append(len(batches))
            computed = list(range(hit, prompt // BLOCK))
            for piece in pieces(computed, k, tails=False):
                stored.add((piece.run, computed[piece.indices[-1]]))
            history = prompt + args.max_tokens
            stored.update((False, b) for b in range(prompt // BLOCK, history // BLOCK))
    print(
        f"{len(heads)} returning turns: HEADs mean {statistics.fmean(heads):.1f} (max {max(heads)}), "
        f"round trips mean {statistics.fmean(rounds):.2f} (max {max(rounds)})"
    )


if __name__ == "__main__":
    main()
