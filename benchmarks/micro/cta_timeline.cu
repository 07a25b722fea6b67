// Where the 64-row decode kernel's time goes, CTA by CTA (ffi/cuda/cta_timeline.cuh): when
// the CTAs start and end against each other (the GPU's nanosecond timer) and how long each
// phase of a CTA takes (SM cycles). For the b = 1 question of issue #9: of the kernel's
// ~15 us, how much is CTA work, how much launch and tail, and which phase is long. For
// b = 128: where a block's time goes in steady state (the repeated phases, added up; at
// h_q <= 16 of the few-heads kernel, which records its start, exit and spans only).
// V32, s_q = 2, top-k 2048 of 32768 tokens a request, every index valid, the default plan
// (33 parts: 132 SMs). Build and run (on an H200):
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -DJSM_CTA_TIMELINE \
//     -I$(python3 -c "import jax.ffi; print(jax.ffi.include_dir())") -Iffi \
//     -o /tmp/cta_timeline benchmarks/micro/cta_timeline.cu ffi/cuda/decode_launch.cu
//   /tmp/cta_timeline [batch=1] [h_q=128] [launches=50] [recorded=1]
// With recorded >= 2 that many launches are recorded one after another, and the tool also says
// whether a CTA's speed stays with its SM from launch to launch, and within a launch from its
// first piece to the rest: what a schedule that hands slow SMs less work could count on.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <vector>

#include "cuda/cta_timeline.cuh"
#include "cuda/decode_common.cuh"
#include "host_problem.h"

namespace {

using jsm::cuda::CtaTimeline;
using jsm::cuda::kTimelineCtas;
namespace tl = jsm::cuda;

// "min / median / max" of `v` (sorted here), scaled by `unit`.
void print_spread(const char* what, std::vector<double> v, double unit, const char* unit_name) {
  if (v.empty()) {
    std::printf("  %-44s (not reached)\n", what);
    return;
  }
  std::sort(v.begin(), v.end());
  std::printf("  %-44s %8.2f %8.2f %8.2f %s (n=%zu)\n", what, v.front() * unit, v[v.size() / 2] * unit,
              v.back() * unit, unit_name, v.size());
}

// Cycles from stamp `a` to stamp `b` of every CTA that reached both.
std::vector<double> phase(const std::vector<CtaTimeline>& ctas, tl::Stamp a, tl::Stamp b) {
  std::vector<double> v;
  for (const auto& c : ctas)
    if (c.clock[a] != 0 && c.clock[b] != 0) v.push_back(static_cast<double>(c.clock[b] - c.clock[a]));
  return v;
}

// The launch's start: the first recorded CTA's entry (nanosecond timer).
unsigned long long launch_start(const std::vector<CtaTimeline>& ctas) {
  unsigned long long first = ~0ull;
  for (const auto& r : ctas)
    if (r.clock[tl::kStampEntry] != 0) first = std::min(first, r.start_ns);
  return first;
}

// Pearson's correlation of x and y (0 when either does not vary).
double correlation(const std::vector<double>& x, const std::vector<double>& y) {
  const size_t n = x.size();
  double mx = 0, my = 0;
  for (size_t i = 0; i < n; ++i) mx += x[i] / n, my += y[i] / n;
  double sxy = 0, sxx = 0, syy = 0;
  for (size_t i = 0; i < n; ++i) {
    sxy += (x[i] - mx) * (y[i] - my);
    sxx += (x[i] - mx) * (x[i] - mx);
    syy += (y[i] - my) * (y[i] - my);
  }
  return sxx > 0 && syy > 0 ? sxy / std::sqrt(sxx * syy) : 0.0;
}

// Whether a CTA's speed is its SM's, over the recorded launches (`ctas_per_slice`: CTAs of one
// head group, x * y of the grid; the pair kernel's clusters are head groups 2k and 2k + 1).
//   Within a launch: a CTA's first piece (first tile -> its output stores begin) against the
//   rest (-> the last piece's stores begin), over the CTAs with two or more pieces.
//   Across launches: the CTA life of each SM in one launch against the next.
//   The end: the slowest cluster's end against the third slowest's (at b = 64 or 128 the 33rd
//   worker idles: a schedule that gave the slowest clusters less work could approach the latter).
void print_speed_persistence(const std::vector<std::vector<CtaTimeline>>& records, int ctas_per_slice, bool pairs) {
  std::printf("is a CTA's speed its SM's? (%zu recorded launches)\n", records.size());
  std::vector<std::map<unsigned, double>> life_by_sm(records.size());
  for (size_t k = 0; k < records.size(); ++k) {
    std::vector<double> first, rest;
    std::map<int, unsigned long long> cluster_end;
    const unsigned long long first_start = launch_start(records[k]);
    for (size_t i = 0; i < records[k].size(); ++i) {
      const CtaTimeline& r = records[k][i];
      if (r.clock[tl::kStampWork] == 0) continue;  // (idle, or not recorded)
      life_by_sm[k][r.smid] = static_cast<double>(r.end_ns - r.start_ns);
      const int slice = static_cast<int>(i) / ctas_per_slice;
      const int cluster = static_cast<int>(i) % ctas_per_slice + ctas_per_slice * (pairs ? slice / 2 : slice);
      cluster_end[cluster] = std::max(cluster_end[cluster], r.end_ns);
      const long long a = r.clock[tl::kStampFirstTile], b = r.clock[tl::kStampFirstPieceEnd],
                      c = r.clock[tl::kStampStoreQK];
      if (a != 0 && b > a && c > b) {
        first.push_back(static_cast<double>(b - a));
        rest.push_back(static_cast<double>(c - b));
      }
    }
    std::vector<double> ends;
    for (const auto& ce : cluster_end) ends.push_back(static_cast<double>(ce.second - first_start));
    std::sort(ends.rbegin(), ends.rend());
    std::printf("  launch %zu: first piece against the rest, correlation %+.2f over %zu CTAs", k + 1,
                correlation(first, rest), first.size());
    if (ends.size() >= 3)
      std::printf("; slowest cluster ends at %.2f us, the third slowest at %.2f", 1e-3 * ends[0], 1e-3 * ends[2]);
    std::printf("\n");
  }
  if (records.size() < 2) return;
  std::vector<double> r;
  for (size_t k = 0; k + 1 < records.size(); ++k) {
    std::vector<double> x, y;
    for (const auto& sl : life_by_sm[k]) {
      const auto it = life_by_sm[k + 1].find(sl.first);
      if (it != life_by_sm[k + 1].end()) x.push_back(sl.second), y.push_back(it->second);
    }
    r.push_back(correlation(x, y));
  }
  std::printf("  CTA life by SM, each launch against the next: correlation");
  for (double v : r) std::printf(" %+.2f", v);
  std::printf("\n");
  // Each SM's mean life over the launches it worked in, and how far its own lives range.
  std::map<unsigned, std::vector<double>> lives;
  for (const auto& m : life_by_sm)
    for (const auto& sl : m) lives[sl.first].push_back(sl.second);
  std::vector<double> means, ranges;
  std::vector<std::pair<double, unsigned>> by_mean;
  for (const auto& sl : lives) {
    if (sl.second.size() < 2) continue;
    double mean = 0;
    for (double v : sl.second) mean += v / sl.second.size();
    means.push_back(mean);
    ranges.push_back(*std::max_element(sl.second.begin(), sl.second.end()) -
                     *std::min_element(sl.second.begin(), sl.second.end()));
    by_mean.push_back({mean, sl.first});
  }
  print_spread("an SM's mean CTA life", means, 1e-3, "us");
  print_spread("an SM's own range (max - min) over launches", ranges, 1e-3, "us");
  std::sort(by_mean.rbegin(), by_mean.rend());
  std::printf("  slowest SMs by mean life (us):");
  for (size_t i = 0; i < std::min<size_t>(6, by_mean.size()); ++i)
    std::printf(" SM %u %.2f;", by_mean[i].second, 1e-3 * by_mean[i].first);
  std::printf("\n");
}

bool check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) std::printf("%s: %s\n", what, cudaGetErrorString(e));
  return e == cudaSuccess;
}

}  // namespace

int main(int argc, char** argv) {
  const int batch = argc > 1 ? std::atoi(argv[1]) : 1;
  const int h_q = argc > 2 ? std::atoi(argv[2]) : 128;
  const int launches = argc > 3 ? std::max(std::atoi(argv[3]), 2) : 50;
  const int recorded = argc > 4 ? std::max(std::atoi(argv[4]), 1) : 1;
  const host_problem::Case c{"timeline", jsm::KVFormat::kV32, batch, 2, h_q, 2048, 0, 64, 64, batch * 512, 0, 0};
  const jsm::DecodeProblem dp = host_problem::make_problem(c, /*garbage=*/false);

  // Back-to-back launches: the time per launch as a stream of them sees it.
  cudaEvent_t t0, t1;
  cudaEventCreate(&t0);
  cudaEventCreate(&t1);
  for (int i = 0; i < 5; ++i) jsm::cuda::launch_decode(dp, nullptr);
  cudaEventRecord(t0);
  for (int i = 0; i < launches; ++i) jsm::cuda::launch_decode(dp, nullptr);
  cudaEventRecord(t1);
  if (!check(cudaEventSynchronize(t1), "launches")) return 1;
  float ms = 0.f;
  cudaEventElapsedTime(&ms, t0, t1);

  // `recorded` more launches, each alone and recorded; the phases below are the last one's.
  std::vector<std::vector<CtaTimeline>> records(recorded, std::vector<CtaTimeline>(kTimelineCtas));
  for (auto& rec : records) {
    if (!check(tl::copy_cta_timeline(rec.data(), /*clear=*/true), "clearing the timeline")) return 1;
    const auto e = jsm::cuda::launch_decode(dp, nullptr);
    if (e.failure()) {
      std::printf("launch: %s\n", e.message().c_str());
      return 1;
    }
    if (!check(cudaDeviceSynchronize(), "recorded launch")) return 1;
    if (!check(tl::copy_cta_timeline(rec.data(), /*clear=*/false), "reading the timeline")) return 1;
  }
  const std::vector<CtaTimeline>& all = records.back();

  std::vector<CtaTimeline> used;
  int idle = 0;
  for (const auto& r : all) {
    if (r.clock[tl::kStampEntry] == 0) continue;
    if (r.clock[tl::kStampWork] == 0) {
      ++idle;
    } else {
      used.push_back(r);
    }
  }
  if (used.empty()) {
    std::printf("no CTA recorded (built without -DJSM_CTA_TIMELINE, or not the 64-row kernel?)\n");
    return 1;
  }
  const unsigned long long first_start = launch_start(all);
  std::vector<double> starts, ends, lives_ns, lives_cycles;
  for (const auto& r : used) {
    starts.push_back(static_cast<double>(r.start_ns - first_start));
    ends.push_back(static_cast<double>(r.end_ns - first_start));
    lives_ns.push_back(static_cast<double>(r.end_ns - r.start_ns));
    lives_cycles.push_back(static_cast<double>(r.clock[tl::kStampExit] - r.clock[tl::kStampEntry]));
  }
  double ns_sum = 0, cyc_sum = 0;
  for (size_t i = 0; i < used.size(); ++i) ns_sum += lives_ns[i], cyc_sum += lives_cycles[i];
  const double ghz = cyc_sum / ns_sum;  // SM cycles per ns, from the CTAs' own lives
  const double us_per_cycle = 1e-3 / ghz;

  std::printf("V32 b=%d s_q=2 h_q=%d top-k 2048: %d CTAs worked, %d idle; %.2f us a launch over %d back-to-back "
              "launches; SM clock %.2f GHz (from the CTAs' lives)\n",
              batch, h_q, static_cast<int>(used.size()), idle, 1e3 * ms / launches, launches, ghz);
  std::printf("  %-44s %8s %8s %8s\n", "", "min", "median", "max");
  std::printf("the recorded launch, nanosecond timer, from the first CTA's start:\n");
  print_spread("CTA start", starts, 1e-3, "us");
  print_spread("CTA end", ends, 1e-3, "us");
  print_spread("CTA life", lives_ns, 1e-3, "us");
  std::printf("phases of a CTA, SM cycles in us:\n");
  const struct {
    const char* what;
    tl::Stamp a, b;
  } phases[] = {
      {"entry -> plan's work item read", tl::kStampEntry, tl::kStampWork},
      {"work item -> barriers + cluster sync", tl::kStampWork, tl::kStampInit},
      {"init -> WG0's registers raised", tl::kStampInit, tl::kStampQKStart},
      {"WG0's registers -> Q's copies issued", tl::kStampQKStart, tl::kStampQIssued},
      {"Q's copies issued -> cluster wait passed", tl::kStampQIssued, tl::kStampQClusterWaited},
      {"cluster wait -> Q landed", tl::kStampQClusterWaited, tl::kStampQ},
      {"init -> Q in shared memory (WG0)", tl::kStampInit, tl::kStampQ},
      {"init -> producer's first rows requested", tl::kStampInit, tl::kStampProducerIssued},
      {"init -> producer's first block stored", tl::kStampInit, tl::kStampProducerStored},
      {"init -> first K tile (WG0)", tl::kStampInit, tl::kStampFirstTile},
      {"first K tile -> WG0's output stores", tl::kStampFirstTile, tl::kStampStoreQK},
      {"WG0's output stores (issue)", tl::kStampStoreQK, tl::kStampStoredQK},
      {"first K tile -> WG1's output stores", tl::kStampFirstTile, tl::kStampStorePV},
      {"WG1's output stores (issue)", tl::kStampStorePV, tl::kStampStoredPV},
      {"init -> producer done", tl::kStampInit, tl::kStampProducerDone},
      {"init -> WG0 done", tl::kStampInit, tl::kStampQKDone},
      {"init -> WG1 done", tl::kStampInit, tl::kStampPVDone},
      {"WG1 done -> exit (cluster barrier)", tl::kStampPVDone, tl::kStampExit},
      {"entry -> exit", tl::kStampEntry, tl::kStampExit},
  };
  for (const auto& ph : phases) print_spread(ph.what, phase(used, ph.a, ph.b), us_per_cycle, "us");

  // Steady state: each repeated phase's cycles added up per CTA (the share of the CTA's life)
  // and per occurrence.
  std::printf("repeated phases: total a CTA (us) and cycles each time (median count a CTA)%s:\n",
              h_q <= 16 ? "; the few-heads kernel: WG0 is its one consumer (S^T, O^T), no WG1" : "");
  const struct {
    const char* what;
    tl::Span k;
  } spans[] = {
      {"WG0 waits for the K tile", tl::kSpanQKWaitTile},
      {"WG0 QK", tl::kSpanQK},
      {"WG0 softmax, P handed over", tl::kSpanSoftmax},
      {"  of it: mask, max, exp, sums, packing", tl::kSpanSoftmaxMath},
      {"  of it: waiting for WG1 to free P", tl::kSpanQKWaitPFree},
      {"  of it: P stores (few-heads: + fence), arrive", tl::kSpanSoftmaxHandOver},
      {"WG0 P V (its half)", tl::kSpanQKPV},
      {"WG0 piece end (sums, stores)", tl::kSpanQKPieceEnd},
      {"  of it: waiting for WG1 at the barrier", tl::kSpanQKPieceEndWait},
      {"  of it: output stores issued", tl::kSpanQKPieceEndStore},
      {"WG0 waits for a later piece's Q", tl::kSpanQKWaitNextQ},
      {"WG1 waits for P", tl::kSpanPVWaitP},
      {"WG1 P V (its half)", tl::kSpanPV},
      {"WG1 piece end (stores)", tl::kSpanPVPieceEnd},
      {"WG1 issues the next piece's Q copies", tl::kSpanPVIssueNextQ},
      {"producer waits for a free buffer", tl::kSpanProducerWaitEmpty},
      {"producer converts and writes a block", tl::kSpanProducerStore},
  };
  for (const auto& sp : spans) {
    std::vector<double> total, each, count, share;
    for (const auto& r : used) {
      if (r.span_count[sp.k] == 0) continue;
      total.push_back(static_cast<double>(r.span_cycles[sp.k]));
      each.push_back(static_cast<double>(r.span_cycles[sp.k]) / r.span_count[sp.k]);
      count.push_back(r.span_count[sp.k]);
      share.push_back(static_cast<double>(r.span_cycles[sp.k]) / (r.clock[tl::kStampExit] - r.clock[tl::kStampEntry]));
    }
    print_spread(sp.what, total, us_per_cycle, "us");
    if (!each.empty()) {
      for (auto* v : {&each, &count, &share}) std::sort(v->begin(), v->end());
      std::printf("  %-44s %8.0f cycles each, median of %.0f a CTA, %.1f%% of its life\n", "", each[each.size() / 2],
                  count[count.size() / 2], 100.0 * share[share.size() / 2]);
    }
  }
  print_speed_persistence(records, dp.num_parts * dp.s_q, h_q > 64);
  return 0;
}
