"""Monte Carlo of the pair kernel's two schedules at b = 64 / 128 (benchmarks/NOTES.md, session
40): the static plan (per query row 32 workers take whole requests, the 33rd none) against
claimed requests (claim_requests.patch: every worker starts with one request and claims the next
`lead` blocks before the end of its current one). A cluster's time per block is its speed,
drawn once per launch (`--sigma-sm`, the SMs' share) times per-request noise (`--sigma-req`).
Prints the mean kernel end of both, in blocks, and checks the claims' ticket accounting.

    python benchmarks/claim_model.py [--sigma-sm 0.009] [--sigma-req 0] [--trials 1000]
"""

import argparse
import heapq

import numpy as np


def static_end(speed, request_time, requests):
    workers = len(speed) - 1  # the last worker idles
    per = requests // workers
    return max(sum(request_time(speed[w]) for _ in range(per)) for w in range(workers))


def claimed_end(speed, request_time, requests, blocks, lead):
    events, tickets, next_request = [], 0, len(speed)
    for w, s in enumerate(speed):
        d = request_time(s)
        heapq.heappush(events, (d * (1 - lead / blocks), w, d))
    end = 0.0
    while events:
        _, w, finish = heapq.heappop(events)
        tickets += 1
        if next_request < requests:
            next_request += 1
            d = request_time(speed[w])
            heapq.heappush(events, (finish + d * (1 - lead / blocks), w, finish + d))
        else:
            end = max(end, finish)
    assert tickets == requests, (tickets, requests)  # one failing claim per cluster
    return end


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sigma-sm", type=float, default=0.009)
    ap.add_argument("--sigma-req", type=float, default=0.0)
    ap.add_argument("--trials", type=int, default=1000)
    ap.add_argument("--lead", type=int, default=5, help="blocks before a request's end at which it claims")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    blocks, clusters = 32, 33
    request_time = lambda s: blocks * s * (1 + args.sigma_req * rng.standard_normal())  # noqa: E731
    for requests in (64, 128):
        static, claimed = [], []
        for _ in range(args.trials):
            rows = [1 + args.sigma_sm * rng.standard_normal(clusters) for _ in range(2)]  # two query rows
            static.append(max(static_end(sp, request_time, requests) for sp in rows))
            claimed.append(max(claimed_end(sp, request_time, requests, blocks, args.lead) for sp in rows))
        s, c = np.mean(static), np.mean(claimed)
        print(f"b={requests}: static {s:.2f} blocks, claimed {c:.2f} ({(c / s - 1) * 100:+.2f}%)")


if __name__ == "__main__":
    main()
