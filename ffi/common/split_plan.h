// The split-KV schedule (docs/schedule.md): plain C++ usable on the host and on the device.
//
// Work is counted in blocks of 64 list entries. Request i has
//   main_blocks(i)  = max(ceil(L_i / 64), 1)   (L_i = clamp(topk_length[i], 0, topk))
//   extra_blocks(i) = ceil(EL_i / 64)           (EL_i likewise for the extra list)
// blocks, numbered main first. Each piece of a request costs its blocks plus
// kPieceOverhead. Workers take requests in order, each up to a budget of
// ceil(total / num_parts) + kPieceOverhead, cutting a request where a budget ends.
//
// Outputs:
//   sched[num_parts][8] = {begin_req, end_req, begin_block, end_block,
//                          begin_split, is_first_split, is_last_split, 0}
//     A worker covers requests begin_req..end_req (inclusive; none when
//     begin_req > end_req). Request r's blocks are
//     [r == begin_req ? begin_block : 0, r == end_req ? end_block : blocks(r)).
//     begin_split is the piece number of begin_req's piece (later requests of the
//     worker start there, piece 0). is_first_split / is_last_split say whether the
//     worker's first piece starts its request and its last piece ends its request.
//   num_splits[b + 1]: prefix sum of the number of pieces per request.
//     A request with one piece writes out/lse directly; a request with several
//     writes piece p to partial slot num_splits[r] + p (< b + num_parts).
//
// Batch-invariant plans (build_invariant_plan) cut request i into chunks of
// kChunkBlocks blocks: chunk k is blocks [k * C, min((k + 1) * C, blocks(i))), and every
// chunk is one piece. Workers take runs of chunks in request order, balanced by cost, but
// a worker never holds two chunks of one request (the kernel would make them one
// piece): the boundary between a request's chunks is always a worker boundary. A
// request's pieces (hence its rounding, and the combine's merge order) then depend on
// its own lengths alone, not on its batch-mates, the batch size or num_parts; which
// worker computes a chunk changes nothing in its arithmetic.
// Such a plan needs num_parts >= invariant_parts_needed(b, topk, extra_topk).
#pragma once

#include <cstdint>

#include "kv_format.h"

namespace jsm {

constexpr int kBlockEntries = 64;
constexpr int kPieceOverhead = 5;
// The bisected budget (fewer requests than workers) stops at pieces of this many blocks: one
// request of 32 blocks at 128 heads ran 17.1 us of decode in 32 one-block pieces against 15.1 in
// 16 two-block ones (H200, session 29), which the cost of kPieceOverhead a piece does not explain.
constexpr int kMinBisectedPieceBlocks = 2;
constexpr int kSchedFields = 8;

enum SchedField : int {
  kBeginReq = 0,
  kEndReq = 1,
  kBeginBlock = 2,
  kEndBlock = 3,
  kBeginSplit = 4,
  kIsFirstSplit = 5,
  kIsLastSplit = 6,
};

JSM_HD int clamp_length(int32_t len, int topk) { return len < 0 ? 0 : (len > topk ? topk : len); }

JSM_HD int ceil_div(int a, int b) { return (a + b - 1) / b; }

JSM_HD int main_blocks(int main_len) {
  const int n = ceil_div(main_len, kBlockEntries);
  return n > 0 ? n : 1;
}

JSM_HD int extra_blocks(int extra_len) { return ceil_div(extra_len, kBlockEntries); }

// Blocks per chunk of a batch-invariant plan: every chunk of a request is its own piece (a
// partial written and merged), so a chunk should hold a whole ordinary request: at 32
// blocks (2048 entries) DeepSeek-V3.2's top-k 2048 is one chunk, hence one piece written
// straight to out, and packing whole requests into workers balances a batch of 64 or more
// within one request per worker. Smaller chunks would split every such request into
// partials (16 blocks cost 27% at b = 128 on an H200: benchmarks/RESULTS.md); longer
// requests are still cut, so their pieces can spread over the workers.
constexpr int kChunkBlocks = 32;

JSM_HD int chunks_of(int blocks) { return ceil_div(blocks, kChunkBlocks); }

// Chunks of the longest request a call with these list sizes can hold.
JSM_HD int max_chunks(int topk, int extra_topk) { return chunks_of(main_blocks(topk) + extra_blocks(extra_topk)); }

// Workers a batch-invariant plan needs: one more than the boundaries between chunks of one
// request that a batch of b requests of full length has.
JSM_HD int64_t invariant_parts_needed(int64_t batch, int topk, int extra_topk) {
  return 1 + batch * (max_chunks(topk, extra_topk) - 1);
}

// The worker count a plan fitted to a GPU of `sms` SMs uses: at most `num_parts`, at most one
// worker per `parts_divisor` SMs (a worker's CTAs: s_q rows times head groups), at least one.
JSM_HD int64_t fitted_parts(int64_t num_parts, int sms, int64_t parts_divisor) {
  int64_t fitted = sms / (parts_divisor > 0 ? parts_divisor : 1);
  if (fitted < 1) fitted = 1;
  return fitted < num_parts ? fitted : num_parts;
}

JSM_HD void clear_row(int32_t* row) {
  for (int k = 0; k < kSchedFields; ++k) row[k] = 0;
}

// A worker with nothing to do.
JSM_HD void set_empty_worker(int32_t* row, int batch) {
  clear_row(row);
  row[kBeginReq] = batch;
  row[kEndReq] = batch - 1;
}

// The list entries one block covers: a range of the main or of the extra list.
struct BlockSpan {
  bool extra;  // false: main list, true: extra list
  int begin;   // first entry
  int end;     // one past the last entry (may equal begin: an empty block)
};

JSM_HD BlockSpan block_span(int block, int main_len, int extra_len) {
  const int mb = main_blocks(main_len);
  BlockSpan s;
  s.extra = block >= mb;
  const int local = s.extra ? block - mb : block;
  const int len = s.extra ? extra_len : main_len;
  s.begin = local * kBlockEntries;
  s.end = s.begin + kBlockEntries < len ? s.begin + kBlockEntries : len;
  if (s.end < s.begin) s.end = s.begin;
  return s;
}

// The walk of build_split_plan with worker budget `budget`: workers take requests in order,
// cutting one where a budget ends. `last_takes_rest`: the last worker takes whatever is left
// (the plan); without it the walk only says whether the workers cover every block (writing
// nothing when sched is null). Returns whether every block was covered.
template <typename BlocksOf>
JSM_HD bool walk_split_plan(int batch, int num_parts, BlocksOf blocks_of, int64_t budget, bool last_takes_rest,
                            int32_t* sched, int32_t* num_splits) {
  int req = 0, block = 0, piece = 0, pieces_before = 0;
  if (num_splits) num_splits[0] = 0;
  for (int w = 0; w < num_parts; ++w) {
    int32_t* row = sched ? sched + w * kSchedFields : nullptr;
    if (req >= batch) {  // nothing left
      if (row) set_empty_worker(row, batch);
      continue;
    }
    if (row) {
      clear_row(row);
      row[kBeginReq] = req;
      row[kBeginBlock] = block;
      row[kBeginSplit] = piece;
      row[kIsFirstSplit] = piece == 0;
    }
    int end_req = req, end_block = block;
    int64_t remain = (last_takes_rest && w == num_parts - 1) ? INT64_MAX / 2 : budget;
    while (req < batch) {
      const int left = blocks_of(req) - block;
      if (remain >= left + kPieceOverhead) {  // the rest of this request fits
        remain -= left + kPieceOverhead;
        end_req = req;
        end_block = block + left;
        pieces_before += piece + 1;
        if (num_splits) num_splits[req + 1] = pieces_before;
        ++req;
        block = 0;
        piece = 0;
      } else {
        const int64_t take = remain - kPieceOverhead;
        if (take > 0) {  // cut the request: this worker does `take` of its blocks
          block += static_cast<int>(take);
          end_req = req;
          end_block = block;
          ++piece;
        }
        break;
      }
    }
    if (row) {
      row[kEndReq] = end_req;
      row[kEndBlock] = end_block;
      row[kIsLastSplit] = end_block == blocks_of(end_req);
    }
  }
  return req >= batch;
}

// `blocks_of(i)` returns the block count of request i (main + extra).
template <typename BlocksOf>
JSM_HD void build_split_plan(int batch, int num_parts, BlocksOf blocks_of, int32_t* sched, int32_t* num_splits) {
  int64_t total = 0;
  for (int i = 0; i < batch; ++i) total += blocks_of(i) + kPieceOverhead;
  int64_t budget = (total + num_parts - 1) / num_parts + kPieceOverhead;
  // Fewer requests than workers: requests are cut whatever the budget, so it is the smallest
  // that covers every block (the largest worker's cost as low as the walk allows), down to
  // kMinBisectedPieceBlocks a piece. 16 requests of 32 blocks over 33 workers then go in
  // 16-block pieces on 32 workers, not 18-block ones on 29. From as many requests as workers
  // the budget stays, so that whole requests stay whole (no combine: docs/schedule.md).
  if (batch < num_parts && walk_split_plan(batch, num_parts, blocks_of, budget, false, nullptr, nullptr)) {
    int64_t lo = kPieceOverhead + kMinBisectedPieceBlocks, hi = budget;  // hi covers
    while (lo < hi) {
      const int64_t mid = lo + (hi - lo) / 2;
      if (walk_split_plan(batch, num_parts, blocks_of, mid, false, nullptr, nullptr)) {
        hi = mid;
      } else {
        lo = mid + 1;
      }
    }
    budget = hi;
  }
  walk_split_plan(batch, num_parts, blocks_of, budget, true, sched, num_splits);
}

// The batch-invariant plan (see the top of this file). The caller checks that
// num_parts >= invariant_parts_needed(batch, topk, extra_topk); `blocks_of` as in
// build_split_plan. Worker w takes the chunks whose cost midpoints fall in its share
// ((w, w + 1] * total / num_parts of the cumulative cost), unless a forced boundary
// comes first or moving on would leave too few workers for the forced boundaries ahead.
template <typename BlocksOf>
JSM_HD void build_invariant_plan(int batch, int num_parts, BlocksOf blocks_of, int32_t* sched, int32_t* num_splits) {
  int64_t total = 0;
  int forced = 0;  // boundaries between chunks of one request not yet passed
  num_splits[0] = 0;
  for (int r = 0; r < batch; ++r) {
    const int blocks = blocks_of(r), chunks = chunks_of(blocks);
    total += blocks + static_cast<int64_t>(chunks) * kPieceOverhead;
    forced += chunks - 1;
    num_splits[r + 1] = num_splits[r] + chunks;
  }
  int w = 0;
  int64_t cum = 0;  // cost of the chunks before this one
  int32_t* row = sched;
  bool empty = true;  // worker w has no chunk yet
  for (int r = 0; r < batch; ++r) {
    const int blocks = blocks_of(r), chunks = chunks_of(blocks);
    for (int k = 0; k < chunks; ++k) {
      const int end = (k + 1) * kChunkBlocks < blocks ? (k + 1) * kChunkBlocks : blocks;
      const int64_t cost = end - k * kChunkBlocks + kPieceOverhead;
      const bool must = k > 0;  // joining chunk k - 1's worker would merge two pieces
      forced -= must;
      const bool past_share = 2 * cum * num_parts + cost * num_parts > 2 * static_cast<int64_t>(w + 1) * total;
      if (empty || must || (past_share && w + 1 + forced < num_parts)) {
        if (!empty) ++w;
        row = sched + static_cast<int64_t>(w) * kSchedFields;
        clear_row(row);
        row[kBeginReq] = r;
        row[kBeginBlock] = k * kChunkBlocks;
        row[kBeginSplit] = k;
        row[kIsFirstSplit] = k == 0;
        empty = false;
      }
      row[kEndReq] = r;
      row[kEndBlock] = end;
      row[kIsLastSplit] = k == chunks - 1;
      cum += cost;
    }
  }
  for (++w; w < num_parts; ++w) set_empty_worker(sched + static_cast<int64_t>(w) * kSchedFields, batch);
}

// The plan of either mode (batch_invariant: build_invariant_plan, else build_split_plan).
template <typename BlocksOf>
JSM_HD void build_plan(bool batch_invariant, int batch, int num_parts, BlocksOf blocks_of, int32_t* sched,
                       int32_t* num_splits) {
  if (batch_invariant) {
    build_invariant_plan(batch, num_parts, blocks_of, sched, num_splits);
  } else {
    build_split_plan(batch, num_parts, blocks_of, sched, num_splits);
  }
}

}  // namespace jsm
