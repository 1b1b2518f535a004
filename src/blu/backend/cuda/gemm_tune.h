// backend/cuda/gemm_tune: the process's GEMM tuning (Note [GEMM tuning], gemm.h) — its setting
// (the environment's until set_gemm_tuning), its counters and the table file's choices, shared by
// every thread's plan cache under one lock. gemm.cpp times the candidates; this file keeps what it
// decides.
// Depends on backend/gemm_tune_table, backend/cuda/gemm.h. Keep: a failed save of the table file
// never fails the run (a warning once; the choice stays in this process).
#pragma once
#include <cstdint>
#include <string>

#include "blu/backend/cuda/gemm.h"
#include "blu/backend/gemm_tune_table.h"

namespace blu::cuda {

// Bumped by set_gemm_tuning: a plan cache made before it is dropped.
uint64_t gemm_tuning_generation();
void gemm_tune_count(int64_t GemmTuneStats::*field);
// The table file's choice for `key` (the file is read on first use; its bad lines are warned about
// on stderr once).
bool gemm_tune_find(const std::string& key, TunedGemm& out);
// Keeps `t` for `key` in this process and in the table file.
void gemm_tune_store(const std::string& key, const TunedGemm& t);

}  // namespace blu::cuda
