// dist/row_exchange: receiving, exchanging and adding a tied embedding's rows.
#include "blu/dist/row_exchange.h"

#include "blu/ops/elementwise.h"
#include "blu/ops/factory.h"
#include "blu/ops/nn.h"
#include "blu/ops/view.h"

namespace blu::dist {

namespace {

std::pair<Tensor, Tensor> flat_rows(const Tensor& idx, const Tensor& g) {
  return {reshape(contiguous(idx), {idx.numel()}), reshape(contiguous(g), {idx.numel(), g.shape().back()})};
}

}  // namespace

void RowExchange::receive(const Tensor& idx, const Tensor& g, const std::string& weight, DType dtype) {
  BLU_CHECK(!idx_.defined(), "the embedding rows of '", weight, "' arrived twice before the step; ",
            "for gradient accumulation run the earlier micro-batches without synchronisation (no_sync / set_sync(false))");
  std::tie(idx_, grad_) = flat_rows(idx, g);
  BLU_CHECK(grad_.dtype() == dtype, "the embedding rows of '", weight, "' are ", grad_.dtype(), ", expected ", dtype,
            " (the weight's dtype)");
}

void RowExchange::issue(ProcessGroup& pg, int64_t V, double gather_limit, int64_t window_rows) {
  const int64_t W = pg.size(), M = idx_.numel(), C = grad_.shape()[1];
  const Device dev = grad_.device();
  if (double(W) * double(M) <= gather_limit * double(V)) {
    path_ = "gather";
    idx_all_ = empty({W * M}, idx_.dtype(), dev);
    grad_all_ = empty({W * M, C}, grad_.dtype(), dev);
    works_.push_back(pg.all_gather(idx_all_, idx_));
    works_.push_back(pg.all_gather(grad_all_, grad_));
  } else if (window_rows == 0) {
    path_ = "dense";
    dense_ = mine_ = zeros({V, C}, grad_.dtype(), dev);
    mine_first_ = 0;
    embedding_backward_add_(dense_, grad_, idx_);
    works_.push_back(pg.all_reduce(dense_, ReduceOp::avg));
  } else {
    path_ = "dense";
    dense_ = zeros({W * window_rows, C}, grad_.dtype(), dev);  // the windows, the last one padded
    embedding_backward_add_(narrow(dense_, 0, 0, V), grad_, idx_);
    mine_ = empty({window_rows, C}, grad_.dtype(), dev);
    mine_first_ = pg.rank() * window_rows;
    works_.push_back(pg.reduce_scatter(reshape(mine_, {window_rows * C}), reshape(dense_, {W * window_rows * C}),
                                       ReduceOp::avg));
  }
  issued_ = true;
}

void RowExchange::add_into(const Tensor& dst, int64_t first_row, int world) {
  for (const WorkPtr& w : works_) w->wait();
  const int64_t rows = dst.shape()[0];
  if (rows > 0) {
    if (path_ == "gather")
      embedding_backward_add_window_(dst, grad_all_, idx_all_, first_row, 1.0 / double(world));
    else
      add_(dst, narrow(mine_, 0, first_row - mine_first_, rows));
  }
  reset();
}

void RowExchange::reset() {
  for (const WorkPtr& w : works_) try {
      w->wait();
    } catch (const std::exception&) {
    }
  works_.clear();
  idx_ = grad_ = idx_all_ = grad_all_ = dense_ = mine_ = Tensor();
  issued_ = false;
}

void RowExchange::add_locally(const Tensor& grad, const Tensor& idx, const Tensor& g) {
  const auto [ids, rows] = flat_rows(idx, g);
  embedding_backward_add_(grad, rows, ids);
}

size_t RowExchange::find_weight(const std::vector<Tensor>& params, const nn::Embedding* emb, const char* owner,
                                const char* missing) {
  BLU_CHECK(emb, owner, ": exchange_rows holds a null embedding");
  for (size_t k = 0; k < params.size(); ++k)
    if (params[k].storage() == emb->weight.storage() && params[k].raw_data() == emb->weight.raw_data()) return k;
  BLU_CHECK(false, owner, ": an exchange_rows embedding (weight ", emb->weight.str(), ") ", missing);
  return 0;
}

}  // namespace blu::dist
