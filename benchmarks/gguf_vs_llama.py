"""crane-mp against llama.cpp's llama-server on the same GGUF files, one server at a time, in one run.

    python -m crane_mp.testing.random_gguf --out /models/qwen3-8b-q4_k_m.gguf     # 5.1 GB, ~30 s
    python benchmarks/gguf_vs_llama.py /models/qwen3-8b-q4_k_m.gguf [more.gguf ...] [--concurrency 1 4 16]

Each server is started the way its users start it: crane-mp with the user's own command
(`crane-launch --model-path FILE --gpu-memory-limit 8G`; 3 GiB above the weights for a file that 8G
cannot hold, such as an 8B Q8_0), llama-server with `-c 16384 -np 16` and
the same threads (`-t N -tb N`, OMP_WAIT_POLICY=PASSIVE as ../shared/peers advises). For each:
ready time (start to /health 200), prefill of a --prefill-len prompt (server-side: the client's TTFT
of a 1-token request), output tok/s and TTFT/TPOT at each concurrency (serving.py's load generator:
streaming /v1/completions, token-id prompts, EOS ignored), and the server's resident memory after
the load (crane-mp: the worker process). Each server starts on the same page cache (--page-cache:
`warm`, the default, reads the file through it first, as a restart after llama-server finds it
(crane-mp drops the pages it has copied unless --keep-page-cache: after it, the file is cold); `cold` drops the file's
pages first, as the first start after a boot finds it): otherwise the server started second finds the
file the first one read, and on a VM whose memory is backed on first touch, reading 10 GB cold costs as
much as either server's whole start. The machine's DRAM read bandwidth is measured in the same
run, before and after each server (a 2 GiB torch.sum on the same threads; the better of the two, as
one sample taken while the host is busy reads low), so every decode figure states its
fraction of the roofline: weight bytes streamed per decode step (the file's tensors less the token
table, which is looked up, not streamed; of a mixture of experts, the share of experts a step's tokens
are routed to) times steps per second (1 / TPOT), over the bandwidth.
Prints one JSON line per measurement and a table. Nothing else should run meanwhile.

A 16-bit model is compared the way its users run each server: crane-mp on the safetensors checkpoint
(`--crane-model DIR`), llama-server on the GGUF llama.cpp's converter made of it:

    python -m crane_mp.testing.make_zoo --family gemma3_text --preset gemma3-4b --dtype bfloat16 --out /models/g3
    bash ../shared/peers/setup.sh gguf /models/g3 /models/g3-bf16.gguf bf16
    python benchmarks/gguf_vs_llama.py /models/g3-bf16.gguf --crane-model /models/g3 --concurrency 1 16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import psutil
import torch
from gguf import GGUFReader

sys.path.insert(0, str(Path(__file__).parent))
from serving import run_load  # noqa: E402

DEFAULT_LLAMA = Path.home() / "peers/llama/build/bin/llama-server"


def dram_read_gbs(threads: int) -> float:
    """Best of 5 sums over 2 GiB of float32 (far past any cache) on `threads` threads."""
    torch.set_num_threads(threads)
    x = torch.ones(1 << 29)
    x.sum()
    best = min(_timed(x.sum) for _ in range(5))
    del x
    return round((1 << 31) / best / 1e9, 1)


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def streamed_bytes(path: Path, streams: int | None = None) -> int:
    """Weight bytes a decode step of `streams` sequences reads: every tensor but the token table (unless
    the head reads it: tied embeddings), a mixture of experts' stacked experts only for the share of them
    the step's tokens are routed to (each token k of E: 1 - (1 - k/E)^streams of them, for routing at
    random), all of them with `streams` None. Read with the gguf package, so files of architectures
    crane-mp does not read yet count too."""
    reader = GGUFReader(str(path))
    sizes = {t.name: int(t.n_bytes) for t in reader.tensors}
    tied = "output.weight" not in sizes
    share = 1.0
    experts = next((int(f.contents()) for key, f in reader.fields.items() if key.endswith(".expert_count")), 0)
    if experts and streams is not None:
        used = next(int(f.contents()) for key, f in reader.fields.items() if key.endswith(".expert_used_count"))
        share = 1 - (1 - used / experts) ** streams
    return int(sum(size * (share if "_exps." in name else 1.0) for name, size in sizes.items()
                   if tied or name != "token_embd.weight"))


def start(server: str, path: Path, port: int, args) -> subprocess.Popen:
    if server == "crane-mp":
        limit = args.memory_limit or f"{max(8, -(-streamed_bytes(path) // 2**30) + 3)}G"
        model = args.crane_model or path
        cmd = [sys.executable, "-m", "crane_mp", "--model-path", str(model), "--gpu-memory-limit", limit,
               "--port", str(port), *args.crane_args]
        env = dict(os.environ)
    else:
        cmd = [str(args.llama_server), "-m", str(path), "--host", "127.0.0.1", "--port", str(port), "-c",
               str(args.llama_context), "-np", str(max(args.concurrency)), "-t", str(args.threads), "-tb",
               str(args.threads), "--no-webui"]
        env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}")
        try:
            if urllib.request.urlopen(url + "/health", timeout=1).status == 200:
                return
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit("server not ready")


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL past a minute."""
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


def resident_bytes(proc: subprocess.Popen) -> int:
    """The largest resident set among the server and its children (crane-mp's worker holds the model)."""
    root = psutil.Process(proc.pid)
    return max(p.memory_info().rss for p in [root, *root.children(recursive=True)])


def load(url: str, concurrency: int, requests: int, prompt_len: int, output_len: int, seed: int, llama: bool):
    return asyncio.run(run_load(SimpleNamespace(
        url=url, concurrency=concurrency, request_rate=None, seed=seed, vocab=8000, num_requests=requests,
        prompt_len=prompt_len, output_len=output_len, new_connection=llama, extra_body=None,
    )))


def set_page_cache(path: Path, state: str) -> None:
    """The file's pages in the page cache (`warm`: read through) or out of it (`cold`: dropped, which
    needs no privilege for a file nobody writes); `asis` leaves them."""
    if state == "asis":
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        if state == "cold":
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            return
        buffer = bytearray(64 << 20)  # one buffer: a new one per read would be fresh memory each time
        offset = 0
        while count := os.preadv(fd, [buffer], offset):
            offset += count
    finally:
        os.close(fd)


def measure(server: str, path: Path, args) -> list[dict]:
    url = f"http://127.0.0.1:{args.port}"
    bandwidth = dram_read_gbs(args.threads)
    set_page_cache(path, args.page_cache)
    began = time.monotonic()
    proc = start(server, path, args.port, args)
    rows = []
    try:
        wait_ready(url, proc)
        ready = time.monotonic() - began
        base = {"server": server, "file": path.name, "ready_s": round(ready, 1), "page_cache": args.page_cache}
        prefill = load(url, 1, 2, args.prefill_len, 1, 1000, server == "llama-server")
        rows.append({**base, "bench": "prefill", "prompt_len": args.prefill_len,
                     "prefill_tok_s": round(args.prefill_len / (prefill["ttft_p50_ms"] / 1e3), 1),
                     "ttft_p50_ms": prefill["ttft_p50_ms"], "errors": prefill["errors"]})
        for concurrency in args.concurrency:
            result = load(url, concurrency, max(args.min_requests, args.waves * concurrency), args.prompt_len,
                          args.output_len, concurrency, server == "llama-server")
            rows.append({**base, **result, "bench": "decode", "rss_gib": round(resident_bytes(proc) / 2**30, 2)})
    finally:
        stop(proc)
    bandwidth = max(bandwidth, dram_read_gbs(args.threads))
    for row in rows:
        row["dram_gbs"] = bandwidth
        if row["bench"] == "decode":
            steps_per_s = 1e3 / row["tpot_p50_ms"] if row["tpot_p50_ms"] else 0.0
            row["roofline"] = round(streamed_bytes(path, row["concurrency"]) * steps_per_s / (bandwidth * 1e9), 3)
        print(json.dumps(row), flush=True)
    return rows


def ready_rounds(path: Path, args) -> None:
    """--ready-rounds N: the servers started and stopped in turn N times before the measured run, each
    start's ready time printed, then each server's median: one start is a sample of a host whose page
    faults cost twice as much from one minute to the next."""
    url = f"http://127.0.0.1:{args.port}"
    times: dict[str, list[float]] = {server: [] for server in args.servers}
    for _ in range(args.ready_rounds):
        for server in args.servers:
            set_page_cache(path, args.page_cache)
            began = time.monotonic()
            proc = start(server, path, args.port, args)
            try:
                wait_ready(url, proc)
                times[server].append(round(time.monotonic() - began, 1))
            finally:
                stop(proc)
    for server, seconds in times.items():
        print(json.dumps({"bench": "ready", "server": server, "file": path.name, "page_cache": args.page_cache,
                          "ready_s": seconds, "median_s": statistics.median(seconds)}), flush=True)


def machine() -> str:
    flags = ""
    if Path("/proc/cpuinfo").exists():
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                wanted = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_int8", "avx_vnni")
                flags = " ".join(f for f in line.split(":")[1].split() if f in wanted)
                break
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    return f"{model}, {os.cpu_count()} CPUs, flags: {flags}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--llama-server", type=Path, default=DEFAULT_LLAMA)
    parser.add_argument("--llama-context", type=int, default=16384, help="llama-server -c (split over its slots)")
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 4, 16])
    parser.add_argument("--waves", type=int, default=2, help="requests per stream at each concurrency")
    parser.add_argument("--min-requests", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=48)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--prefill-len", type=int, default=512)
    parser.add_argument("--memory-limit", help="crane-mp's --gpu-memory-limit (default: 8G, or the weights + 3 GiB)")
    parser.add_argument("--page-cache", choices=["warm", "cold", "asis"], default="warm",
                        help="the file's pages before each server starts (see above)")
    parser.add_argument("--ready-rounds", type=int, default=0,
                        help="start and stop the servers in turn this many times first, for ready time's median")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--port", type=int, default=8311)
    parser.add_argument("--servers", nargs="+", default=["crane-mp", "llama-server"])
    parser.add_argument("--crane-model", type=Path, help="what crane-mp serves instead of the file: the "
                        "safetensors checkpoint it was converted from")
    parser.add_argument("--crane-args", nargs=argparse.REMAINDER, default=[], help="extra crane-launch flags (last)")
    args = parser.parse_args()
    print(json.dumps({"machine": machine(), "date": time.strftime("%Y-%m-%d")}), flush=True)
    for path in args.files if args.ready_rounds else []:
        ready_rounds(path, args)
    rows = [row for path in args.files for server in args.servers for row in measure(server, path, args)]
    print(f"\n{'file':<26} {'server':<12} {'ready s':>7} {'prefill tok/s':>13} {'C':>3} {'tok/s':>7} "
          f"{'TTFT p50':>9} {'TPOT p50':>9} {'roofline':>8} {'RSS GiB':>7} {'errors':>6}")
    for r in rows:
        if r["bench"] == "prefill":
            print(f"{r['file']:<26} {r['server']:<12} {r['ready_s']:>7} {r['prefill_tok_s']:>13}")
        else:
            print(f"{r['file']:<26} {r['server']:<12} {'':>7} {'':>13} {r['concurrency']:>3} {r['output_tok_s']:>7} "
                  f"{r['ttft_p50_ms']:>9} {r['tpot_p50_ms']:>9} {r['roofline']:>8} {r['rss_gib']:>7} {r['errors']:>6}")


if __name__ == "__main__":
    main()
