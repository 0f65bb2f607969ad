"""Probe (issue 43, runs 225-226): with an empty compile cache, what does this process write into the cache during batch 1's
warm-ups (a cache miss writes; kernels the workers compiled are only read), and where the first two warm-ups'
time goes (cProfile)."""
import cProfile, io, pstats, sys, tempfile, threading, time
from pathlib import Path


def main():
    import triton.runtime.cache as C
    puts = []
    orig = C.FileCacheManager.put

    def put(self, data, filename, binary=True):
        puts.append((time.perf_counter(), threading.current_thread().name, filename))
        return orig(self, data, filename, binary)

    C.FileCacheManager.put = put
    from vlaserve import Policy
    from vlaserve.runtime.fast import graphs as G
    timed = []
    orig_warm = G.FastRunner._warm_up

    def warm(self, fn, runs):
        prof = cProfile.Profile() if len(timed) < 3 else None
        t = time.perf_counter()
        if prof:
            prof.enable()
        try:
            return orig_warm(self, fn, runs)
        finally:
            if prof:
                prof.disable()
            timed.append((t, time.perf_counter() - t, prof))

    G.FastRunner._warm_up = warm
    t0 = time.perf_counter()
    cache = tempfile.mkdtemp(prefix="cc-")
    policy = Policy.from_pretrained(sys.argv[1], device="cuda", warmup="blocking", progress=False, max_batch_size=1,
                                    compile_cache=cache)
    print("loaded + b1 plan in %.1f s" % (time.perf_counter() - t0), policy.runtime.stats()["graphs"].get("compile_ahead_s"))
    for t, d, prof in timed[:8]:
        print("warm-up at %.2f s took %.3f s" % (t - t0, d))
    for t, th, name in puts:
        print("put %.2f %s %s" % (t - t0, th, name))
    for t, d, prof in timed[:3]:
        if prof:
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(14)
            print("\n".join(s.getvalue().splitlines()[:34]))


if __name__ == "__main__":
    main()
