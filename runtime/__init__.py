"""Engine runners, KV pool and page tables, requests, sampling and profiling."""
