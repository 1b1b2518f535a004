// dist/row_exchange: the exchange of a tied embedding's rows across ranks, shared by DDP (Row
// exchange in dist/ddp.h) and ZeRO-2 (Note [ZeRO-2 row exchange], dist/zero.cpp). The embedding
// hands the gradient of its output to its owner through nn::Embedding's row sink instead of adding
// it into the weight's gradient; the owner keeps them here, issues the exchange after its last
// bucket, and adds the averaged rows into the rows of the weight's gradient it holds:
//   gather — while world × tokens ≤ gather_limit × vocabulary (fewer bytes than a dense gradient):
//     every rank's ids and rows all-gathered, then added (scaled 1/world) into the rows of the
//     destination's window; deterministic, every rank adding the same rows in the same order.
//   dense — otherwise: the rows summed locally into a dense gradient, then averaged: all-reduced
//     (every rank holds the whole table: DDP) or reduce-scattered into windows of `window_rows`
//     rows (ZeRO-2: rank r gets rows [r·window_rows, …)).
// Depends on dist/process_group, nn/layers, ops/. Keep: the caller issues exchanges in the same
// order on every rank (collectives match), after its buckets; tensors live until add_into() or
// reset() (the collectives may still read them).
#pragma once
#include <string>
#include <vector>

#include "blu/dist/process_group.h"
#include "blu/nn/layers.h"

namespace blu::dist {

class RowExchange {
 public:
  RowExchange(nn::Embedding* emb, size_t param) : emb_(emb), param_(param) {}
  nn::Embedding* embedding() const { return emb_; }
  size_t param() const { return param_; }  // the weight's index among the owner's parameters

  // This round's rows from the sink: ids (any shape) and the gradient of the embedding's output
  // ([ids..., C], in the weight's dtype `dtype`), flattened. A second call before reset() is an
  // error naming `weight`.
  void receive(const Tensor& idx, const Tensor& g, const std::string& weight, DType dtype);
  bool received() const { return idx_.defined(); }
  bool issued() const { return issued_; }
  // Issues the exchange of the received rows for a [V, C] table over pg (see the header comment;
  // window_rows 0: every rank wants all V rows).
  void issue(ProcessGroup& pg, int64_t V, double gather_limit, int64_t window_rows);
  // Waits for the exchange and adds the averaged rows into dst, rows [first_row, first_row +
  // dst.size(0)) of the table (the gathered ids outside it belong to other ranks' windows); then
  // reset(). A failed collective throws.
  void add_into(const Tensor& dst, int64_t first_row, int world);
  // Waits for what was issued (errors dropped) and drops this round's tensors.
  void reset();
  // "gather" or "dense": how the last issued round exchanged ("" before the first).
  const std::string& path() const { return path_; }

  // Adds rows straight into a local gradient [V, C] (gradient accumulation before the synced step).
  static void add_locally(const Tensor& grad, const Tensor& idx, const Tensor& g);
  // Index of emb's weight among params (the same storage and data); errors name `owner`, and
  // `missing` says where the weight was not found.
  static size_t find_weight(const std::vector<Tensor>& params, const nn::Embedding* emb, const char* owner,
                            const char* missing);

 private:
  nn::Embedding* emb_;
  size_t param_;
  Tensor idx_, grad_;         // ids [M], rows [M, C]
  bool issued_ = false;
  Tensor idx_all_, grad_all_;  // gather: every rank's ids and rows, rank after rank
  Tensor dense_, mine_;        // dense: the local sum [V or W·R, C]; the averaged rows this rank adds
  int64_t mine_first_ = 0;     // the table row mine_ starts at
  std::vector<WorkPtr> works_;
  std::string path_;
};

}  // namespace blu::dist
