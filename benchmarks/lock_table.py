"""Lock-table benchmark: false-conflict rate of ``hashed`` against ``exact``, and throughput.

    python benchmarks/lock_table.py [--transactions 200000] [--seed 1]

False-conflict workload (one commit stream per lock-universe size K):

* K distinct lock hashes, drawn at random from the 32-bit range (seeded);
* every transaction writes ONE lock drawn uniformly from the K and commits (ids 0, 1, 2, ...),
  so both tables see the identical history; ``warm-up`` transactions are committed first so the
  hashed table is in steady state;
* before each commit, the transaction's lock is checked in both tables for a client whose
  high-water mark is ``lag`` transactions behind the commit head (``client = head - lag``), for
  several lags at once (lag 0 = the client has seen everything);
* false-conflict rate = (hashed says conflict, exact says safe) / (exact says safe).

Throughput: one ``begin + check + commit`` cycle per transaction, nothing else in flight, for a
request with 1 write lock and for one with 2 write + 2 read + 1 append locks, over 10k hot locks.
Figures depend on the machine; nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import random
import time

from waltz_core.locks import Begin, ExactLockTable, HashedLockTable, LockRequest

LAGS = (0, 10, 100, 1000, 10_000)
UNIVERSES = (1_000, 10_000, 100_000)


def false_conflicts(universe: int, transactions: int, warm_up: int, rng: random.Random,
                    size: int, hash_count: int) -> list[tuple[int, int, int, int]]:
    """Per lag: (lag, checks, exact conflicts, false conflicts)."""
    locks = rng.sample(range(-(2**31), 2**31), universe)
    requests = [LockRequest((lock,)) for lock in locks]
    hashed, exact = HashedLockTable(size, hash_count, -1), ExactLockTable(-1)
    choose = rng.randrange
    txn = -1
    for _ in range(warm_up):
        request = requests[choose(universe)]
        txn += 1
        hashed.begin(request)
        hashed.commit(request, txn)
        exact.begin(request)
        exact.commit(request, txn)
    true_hits = dict.fromkeys(LAGS, 0)
    false_hits = dict.fromkeys(LAGS, 0)
    missed = 0
    for _ in range(transactions):
        request = requests[choose(universe)]
        for lag in LAGS:
            client = txn - lag
            if exact.check(request, client) is not None:
                true_hits[lag] += 1
                if hashed.check(request, client) is None:
                    missed += 1  # a false "safe": must never happen
            elif hashed.check(request, client) is not None:
                false_hits[lag] += 1
        txn += 1
        hashed.begin(request)
        hashed.commit(request, txn)
        exact.begin(request)
        exact.commit(request, txn)
    if missed:
        raise AssertionError(f"hashed reported safe {missed} times where exact reported a conflict")
    return [(lag, transactions, true_hits[lag], false_hits[lag]) for lag in LAGS]


def throughput(table: HashedLockTable | ExactLockTable, requests: list[LockRequest], cycles: int) -> float:
    """begin + check + commit cycles per second (client always up to date)."""
    n = len(requests)
    begin, check, commit = table.begin, table.check, table.commit
    ok = Begin.OK
    start = time.perf_counter()
    for txn in range(cycles):
        request = requests[txn % n]
        if begin(request) is not ok:
            raise AssertionError("busy with nothing in flight")
        if check(request, txn - 1) is None:
            commit(request, txn)
        else:
            table.abort(request)
    return cycles / (time.perf_counter() - start)


def check_commit_only(table: HashedLockTable | ExactLockTable, requests: list[LockRequest], cycles: int) -> float:
    """check + commit pairs per second, skipping begin (what a server without pipelining would call)."""
    n = len(requests)
    check, commit = table.check, table.commit
    start = time.perf_counter()
    for txn in range(cycles):
        request = requests[txn % n]
        check(request, txn - 1)
        commit(request, txn)
    return cycles / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--transactions", type=int, default=200_000, help="measured transactions per universe")
    parser.add_argument("--size", type=int, default=30_000, help="hashed table slots (L)")
    parser.add_argument("--hash-count", type=int, default=3, help="hashed table hash functions (N)")
    parser.add_argument("--cycles", type=int, default=300_000, help="cycles per throughput measurement")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    rng = random.Random(args.seed)

    print(f"false conflicts of hashed ({args.size} x {args.hash_count}) vs exact; "
          f"1 random write lock per txn, {args.transactions:,} checked txns per row")
    print(f"{'locks':>8} {'warm-up':>8} {'lag':>6} {'true conflicts':>15} {'exact-safe':>11} "
          f"{'false conflicts':>16} {'false rate':>11}")
    for universe in UNIVERSES:
        warm_up = max(2 * universe, 50_000)
        t0 = time.perf_counter()
        rows = false_conflicts(universe, args.transactions, warm_up, rng, args.size, args.hash_count)
        for lag, checks, true_hits, false_hits in rows:
            safe = checks - true_hits
            rate = false_hits / safe if safe else float("nan")
            print(f"{universe:>8,} {warm_up:>8,} {lag:>6,} {true_hits / checks:>14.2%} {safe:>11,} "
                  f"{false_hits:>16,} {rate:>11.4%}")
        print(f"{'':>8} ({time.perf_counter() - t0:.1f} s; hashed never said safe where exact conflicted)")

    hot = rng.sample(range(-(2**31), 2**31), 10_000)
    shapes = {
        "1 write": [LockRequest((lock,)) for lock in hot],
        "2w+2r+1a": [LockRequest((hot[i], hot[i - 1]), (hot[i - 2], hot[i - 3]), (hot[i - 4],))
                     for i in range(len(hot))],
    }
    print(f"\nthroughput, {args.cycles:,} cycles over 10,000 hot locks (best of 3)")
    print(f"{'strategy':>10} {'request':>10} {'begin+check+commit/s':>22} {'check+commit/s':>16}")
    for name, make in (("hashed", lambda: HashedLockTable(args.size, args.hash_count, -1)),
                       ("exact", lambda: ExactLockTable(-1))):
        for shape, requests in shapes.items():
            full = max(throughput(make(), requests, args.cycles) for _ in range(3))
            pair = max(check_commit_only(make(), requests, args.cycles) for _ in range(3))
            print(f"{name:>10} {shape:>10} {full:>22,.0f} {pair:>16,.0f}")


if __name__ == "__main__":
    main()
