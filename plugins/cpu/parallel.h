// The CPU references run inside one ORT kernel call: parallel_for spreads their independent tasks (GEMM row
// blocks, attention heads) over the machine's cores with plain std::threads.
#pragma once

#include <algorithm>
#include <cstdint>
#include <thread>
#include <vector>

namespace gtco {
namespace ref {

// Threads worth starting for `tasks` independent tasks of `work` multiply-adds in all (small work stays on one).
inline int64_t worth_threads(int64_t tasks, int64_t work) {
    const int64_t hw = std::max<int64_t>(1, static_cast<int64_t>(std::thread::hardware_concurrency()));
    return work < (int64_t{1} << 20) ? 1 : std::max<int64_t>(1, std::min(hw, tasks));
}

// run(t) for t in [0, threads): t = 0 on the calling thread, the others on their own.
template <class Fn>
void parallel_for(int64_t threads, Fn run) {
    std::vector<std::thread> pool;
    for (int64_t t = 1; t < threads; ++t) pool.emplace_back(run, t);
    run(0);
    for (auto& th : pool) th.join();
}

}  // namespace ref
}  // namespace gtco
