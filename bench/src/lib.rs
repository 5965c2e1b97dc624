//! corral's benchmarks. The criterion micro-benchmarks live in
//! `benches/`; load scenarios (oha against real processes) in `bench/run.sh`.
