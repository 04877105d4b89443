"""The ledger at thousands of ranks: what a restart reads, old path against new, on S3 with latency.

    python benchmarks/ledger_scale.py [--sizes 1000x10 8000x20] [--latency 0.03] [--old-sample 300]

No corpus and no training: ledgers are generated. Run ``r`` of ``R`` has ``N`` ranks; each rank file
holds 2 commits (steps 100 and 200), each half of one 1,000-sample shard (shard ``(r*N + k) mod
100,000`` for rank ``k``, 40-character URLs, its dataset identity recorded), and names the lineage it
resumed from, as a chain of runs does. The files are put straight into a moto S3 server (in this
process, not through HTTP: generating is not what is measured); every read then goes through a
proxy on 127.0.0.1 that adds ``--latency`` seconds to each request (what an object store's small GET
costs) and counts the requests and the bytes it returns.

Per size, one process, through the proxy:

1. **old path**: what every rank did on an elastic resume before: list the whole ledger, then GET
   and merge every rank file one after another. Timed on the first ``--old-sample`` files (after
   the full listing), projected linearly to all of them.
2. **new, full read** (no snapshot yet: what rank 0, or ``wdsraft ledger compact``, pays once):
   every rank file of the lineage, listed per run and read 32 at a time. Sizes above
   ``--full-limit`` files are projected from the per-file time of the smaller size.
3. **new, snapshot one run behind** (the snapshot of the previous restart, then one more run):
   the snapshot plus the last run's ``N`` files: what ``ledger compact`` between two jobs, or rank
   0 under torch.distributed, reads per restart.
4. **new, a rank's resume**: the snapshot of the checkpoint's watermark is there: one GET.
5. **ledger show**: the whole ledger, read in parallel (timed where the full read is).

Peak memory: the process's RSS above its level before the step, sampled every 5 ms. Also printed:
the size of the ledger (a snapshot of the committed truth) for an epoch of 10^5 shards x 10^5
samples (10^10 samples) consumed sequentially, computed from real bitmaps, not written.
"""

from __future__ import annotations

import argparse
import http.client
import io
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from contextlib import redirect_stderr, redirect_stdout
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import msgpack  # noqa: E402
from pyroaring import BitMap  # noqa: E402

from wdsraft.ledger.consumed import ConsumedSet  # noqa: E402
from wdsraft.ledger.gathered import SnapshotChain  # noqa: E402
from wdsraft.ledger.identity import ShardIdentities  # noqa: E402
from wdsraft.ledger.merged import merge_under  # noqa: E402
from wdsraft.ledger.rank_file import RankFile, RunSummary, commit_entries, counted, summarize  # noqa: E402
from wdsraft.ledger.reading import list_rank_files  # noqa: E402
from wdsraft.ledger.snapshot import Snapshot, write_snapshot  # noqa: E402

SHARDS, PER_SHARD = 100_000, 1000
BUCKET = "ledgers"


def shard_url(shard: int) -> str:
    return f"s3://bucket/dataset/train-{shard:06d}.tar"  # 40 characters, as in benchmarks/ledger.py


# -- the S3 endpoint and the latency proxy ---------------------------------------------------------


class Counter:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests: dict[str, int] = {}
        self.bytes = 0

    def add(self, kind: str, size: int) -> None:
        with self.lock:
            self.requests[kind] = self.requests.get(kind, 0) + 1
            self.bytes += size

    def reset(self) -> None:
        with self.lock:
            self.requests, self.bytes = {}, 0

    def total(self) -> int:
        return sum(self.requests.values())


def start_proxy(upstream_port: int, latency: float, counter: Counter) -> ThreadingHTTPServer:
    """An HTTP proxy to the moto server that sleeps ``latency`` before each request and counts them."""
    local = threading.local()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:
            pass

        def forward(self) -> None:
            if self.path.startswith("/__counter__"):  # (the benchmark's own control requests: not counted)
                reset = self.path.endswith("reset")
                with counter.lock:
                    data = json.dumps({"requests": counter.requests, "bytes": counter.bytes}).encode()
                if reset:
                    counter.reset()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                return
            time.sleep(latency)
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else None
            connection = getattr(local, "connection", None)
            if connection is None:
                connection = local.connection = http.client.HTTPConnection("127.0.0.1", upstream_port)
            headers = {k: v for k, v in self.headers.items() if k.lower() != "connection"}
            connection.request(self.command, self.path, body=body, headers=headers)
            response = connection.getresponse()
            data = response.read()
            listing = self.command == "GET" and "list-type" in self.path
            counter.add("LIST" if listing else self.command, len(data))
            self.send_response(response.status)
            for key, value in response.getheaders():
                if key.lower() not in ("transfer-encoding", "connection", "content-length"):
                    self.send_header(key, value)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

        do_GET = do_PUT = do_HEAD = do_POST = do_DELETE = forward

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def start_moto() -> tuple[Any, int]:
    from moto.server import ThreadedMotoServer

    os.environ.update({"AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "x", "AWS_DEFAULT_REGION": "us-east-1"})
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    port = server._server.server_port  # (moto picks a free port for 0)
    return server, port


def backend() -> Any:
    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.s3.models import s3_backends

    return s3_backends[DEFAULT_ACCOUNT_ID]["aws"]


# -- generated ledgers -----------------------------------------------------------------------------


def rank_file_of(
    prefix: str, r: int, k: int, ranks: int, lineage: dict[str, int], steps: dict[str, int | None]
) -> RankFile:
    """Rank ``k``'s file of run ``r`` (the same bytes wherever it is made: the benchmark rebuilds what a rank
    sends rank 0 at a checkpoint from it)."""
    run = f"job{r:04d}"
    shard = (r * ranks + k) % SHARDS
    rank_file = RankFile(f"s3://{BUCKET}/{prefix}/run-{run}/rank-{k:05d}.ledger", run, k, ranks, dict(lineage))
    rank_file.parent_steps = dict(steps)
    for number, (step, half) in enumerate(((100, range(0, 500)), (200, range(500, 1000))), 1):
        consumed = ConsumedSet()
        consumed.add_samples(shard_url(shard), half)
        identity = {"sha256": f"{shard:064x}", "samples": PER_SHARD, "size": 1_000_000}
        rank_file.commits.append(
            {
                "commit": number,
                "step": step,
                "time": 1e9 + r,
                "epochs": {"0": consumed.to_plain()},
                "shards": {shard_url(shard): identity} if number == 1 else {},
            }
        )
    rank_file.size = len(rank_file.to_bytes())
    return rank_file


def watermarks(runs: int) -> list[tuple[dict[str, int], dict[str, int | None]]]:
    """Each run's watermark (its last commit, step 200), each run resuming from the one before."""
    lineage: dict[str, int] = {}
    steps: dict[str, int | None] = {}
    marks = []
    for r in range(runs):
        lineage, steps = {**lineage, f"job{r:04d}": 2}, {**steps, f"job{r:04d}": 200}
        marks.append((dict(lineage), dict(steps)))
    return marks


def generate(prefix: str, ranks: int, runs: int) -> list[tuple[dict[str, int], dict[str, int | None]]]:
    """Write the ledger of ``runs`` chained runs of ``ranks`` ranks; returns each run's watermark."""
    store = backend()
    marks = watermarks(runs)
    for r in range(runs):
        lineage, steps = marks[r - 1] if r else ({}, {})
        for k in range(ranks):
            rank_file = rank_file_of(prefix, r, k, ranks, lineage, steps)
            store.put_object(BUCKET, f"{prefix}/run-job{r:04d}/rank-{k:05d}.ledger", rank_file.to_bytes())
    return marks


def summaries(prefix: str, ranks: int, runs: int) -> dict[str, RunSummary]:
    """What the rank files of the first ``runs`` runs say, in little (as a snapshot keeps it)."""
    marks = watermarks(runs)
    found = {}
    for r in range(runs):
        lineage, steps = marks[r - 1] if r else ({}, {})
        found.update(summarize(rank_file_of(prefix, r, k, ranks, lineage, steps) for k in range(ranks)))
    return found


def generated(ranks: int, runs: int) -> tuple[dict[int, ConsumedSet], dict[str, Any]]:
    """What ``generate`` made the first ``runs`` runs consume, and the identities they recorded."""
    consumed = ConsumedSet()
    shards = sorted({(r * ranks + k) % SHARDS for r in range(runs) for k in range(ranks)})
    for shard in shards:
        consumed.samples[shard_url(shard)] = BitMap(range(PER_SHARD))
    identities = {shard_url(s): {"sha256": f"{s:064x}", "samples": PER_SHARD, "size": 1_000_000} for s in shards}
    return {0: consumed}, identities


# -- measuring -------------------------------------------------------------------------------------


class PeakRss:
    """The process's peak resident memory above its level at the start, sampled every 5 ms."""

    def __enter__(self) -> PeakRss:
        self.base = self.peak = self._rss()
        self.running = True
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _rss(self) -> int:
        with open("/proc/self/statm") as stream:
            return int(stream.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _sample(self) -> None:
        while self.running:
            self.peak = max(self.peak, self._rss())
            time.sleep(0.005)

    def __exit__(self, *exc: object) -> None:
        self.running = False
        self.thread.join()
        self.peak = max(self.peak, self._rss())

    @property
    def mib(self) -> float:
        return (self.peak - self.base) / 2**20


def old_path(path: str, lineage: dict[str, int], steps: dict[str, int | None], sample: int) -> dict[str, float]:
    """The read of every rank file before this change (ledger.py's listing and reading, one by one)."""
    from wdsraft.io.s3 import s3_client

    started = time.perf_counter()
    bucket, _, prefix = path.removeprefix("s3://").partition("/")
    paginator = s3_client().get_paginator("list_objects_v2")
    keys = sorted(
        item["Key"]
        for page in paginator.paginate(Bucket=bucket, Prefix=prefix + "/")
        for item in page.get("Contents", [])
        if item["Key"].endswith(".ledger")
    )
    listed = time.perf_counter()
    merged = ConsumedSet()
    for key in keys[:sample]:
        raw = s3_client().get_object(Bucket=bucket, Key=key)["Body"].read()
        rank_file = RankFile.parse(f"s3://{bucket}/{key}", raw)
        for commit in rank_file.commits:
            if counted(commit, rank_file.run, lineage, steps):
                record = commit["epochs"].get("0")
                if record:
                    merged.update(ConsumedSet.from_plain(record))
    per_file = (time.perf_counter() - listed) / min(sample, len(keys))
    return {"files": len(keys), "list_s": listed - started, "per_file_s": per_file}


def new_read(path: str, lineage: dict[str, int], steps: dict[str, int | None], use_snapshots: bool) -> Any:
    return merge_under(path, lineage, steps, ShardIdentities(path), use_snapshots=use_snapshots)


class RemoteCounter:
    """The proxy's counts, read from the serving process (which runs moto and the proxy, so that their
    work is not counted in the reading process's time)."""

    def __init__(self, port: int):
        self.port = port

    def fetch(self, reset: bool = False) -> dict[str, Any]:
        connection = http.client.HTTPConnection("127.0.0.1", self.port)
        connection.request("GET", "/__counter__" + ("/reset" if reset else ""))
        found: dict[str, Any] = json.loads(connection.getresponse().read())
        connection.close()
        return found


def measure(counter: RemoteCounter, action: Any) -> dict[str, Any]:
    counter.fetch(reset=True)
    with PeakRss() as memory:
        started, cpu = time.perf_counter(), time.process_time()
        result = action()
        elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
    counts = counter.fetch()
    return {
        "s": elapsed,
        "cpu": cpu,
        "requests": counts["requests"],
        "reads": sum(counts["requests"].values()),
        "bytes": counts["bytes"],
        "mib": memory.mib,
        "result": result,
    }


def sequential_epoch_size() -> dict[str, int]:
    """Bytes of the snapshot of an epoch of 10^5 shards x 10^5 samples consumed whole (sequential reading)."""
    consumed = ConsumedSet()
    size = 100_000
    for shard in range(SHARDS):
        consumed.samples[shard_url(shard)] = BitMap(range(size))
    identities = {shard_url(s): {"sha256": f"{s:064x}", "samples": size, "size": 10**9} for s in range(SHARDS)}
    bare = Snapshot("s3://b/ledger", {"job": 1}, {"job": 1}, {0: consumed}).to_bytes()
    full = Snapshot("s3://b/ledger", {"job": 1}, {"job": 1}, {0: consumed}, identities).to_bytes()
    one = len(msgpack.packb(consumed.samples[shard_url(0)].serialize()))
    return {"snapshot": len(full), "without_identities": len(bare), "bitmap": one}


def serve(sizes: list[str], latency: float) -> None:
    """The serving process: moto, the generated ledgers, the proxy; prints the proxy's port and the
    watermarks as one JSON line, then serves until its standard input closes."""
    import logging

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    moto, moto_port = start_moto()
    backend().create_bucket(BUCKET, "us-east-1")
    marks = {}
    for spec in sizes:
        ranks, runs = (int(x) for x in spec.split("x"))
        started = time.perf_counter()
        marks[spec] = generate(f"l{ranks}x{runs}", ranks, runs)
        print(f"generated {spec} in {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    proxy = start_proxy(moto_port, latency, Counter())
    print(json.dumps({"port": proxy.server_port, "marks": marks}), flush=True)
    sys.stdin.read()
    proxy.shutdown()
    moto.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", nargs="+", default=["1000x10", "8000x20"], help="RANKSxRUNS")
    parser.add_argument("--latency", type=float, default=0.03)
    parser.add_argument("--old-sample", type=int, default=300)
    parser.add_argument("--full-limit", type=int, default=20_000, help="read at most this many files in full")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.environ.update({"AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "x", "AWS_DEFAULT_REGION": "us-east-1"})
    if args.serve:
        serve(args.sizes, args.latency)
        return

    with open("/proc/loadavg") as stream:
        print(f"load average before: {stream.read().split()[0]}; no corpus (generated ledgers)")
    sizes = sequential_epoch_size()
    print(
        f"sequential epoch of 10^5 shards x 10^5 samples: snapshot {sizes['snapshot'] / 1e6:.1f} MB "
        f"({sizes['without_identities'] / 1e6:.1f} MB without the identities; one shard's bitmap "
        f"{sizes['bitmap']} bytes)",
        flush=True,
    )
    command = [sys.executable, __file__, "--serve", "--latency", str(args.latency), "--sizes", *args.sizes]
    server = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        hello = json.loads(server.stdout.readline())
        os.environ["AWS_ENDPOINT_URL"] = f"http://127.0.0.1:{hello['port']}"
        counter = RemoteCounter(hello["port"])
        print(f"latency {args.latency * 1000:.0f} ms per request (moto and the proxy in another process)")
        full_per_file: float | None = None
        for spec in args.sizes:
            full_per_file = run_size(spec, hello["marks"][spec], counter, args, full_per_file)
    finally:
        server.communicate("", timeout=60)
    with open("/proc/loadavg") as stream:
        print(f"\nload average after: {stream.read().split()[0]}")


def run_size(spec: str, marks: list[Any], counter: RemoteCounter, args: Any, full_per_file: float | None) -> Any:
    ranks, runs = (int(x) for x in spec.split("x"))
    path = f"s3://{BUCKET}/l{ranks}x{runs}"
    files = ranks * runs
    print(f"\n== {ranks} ranks x {runs} runs = {files:,} rank files", flush=True)
    lineage, steps = marks[-1]

    list_rank_files(path, [next(iter(lineage))])  # (warm up: the clients and their imports)
    counter.fetch(reset=True)
    old = old_path(path, lineage, steps, args.old_sample)
    old_list_reads = counter.fetch()["requests"].get("LIST", 0)
    old_rank = old["list_s"] + old["per_file_s"] * files
    print(
        f"old path, per rank: {old_rank:.0f} s (listing {old['list_s']:.1f} s in {old_list_reads} requests, "
        f"{old['per_file_s'] * 1000:.1f} ms per file over {args.old_sample} files, projected to {files:,}); "
        f"object reads per restart: {ranks:,} ranks x {files + old_list_reads:,} = "
        f"{ranks * (files + old_list_reads):,}",
        flush=True,
    )

    if files <= args.full_limit:
        full = measure(counter, lambda: new_read(path, lineage, steps, use_snapshots=False))
        full_per_file = full["s"] / files
        print(
            f"new, full read (no snapshot): {full['s']:.2f} s ({full['cpu']:.1f} s CPU), {full['reads']:,} requests "
            f"{full['requests']}, "
            f"{full['bytes'] / 1e6:.1f} MB, peak +{full['mib']:.0f} MiB",
            flush=True,
        )
        shown = measure(counter, lambda: _show(path))
        print(
            f"ledger show, no snapshot yet (reads every file): {shown['s']:.2f} s, {shown['reads']:,} requests, "
            f"peak +{shown['mib']:.0f} MiB",
            flush=True,
        )
    elif full_per_file is not None:
        print(
            f"new, full read (no snapshot): projected {full_per_file * files:.0f} s "
            f"({full_per_file * 1000:.2f} ms per file, from the size before); ledger show without a snapshot: the same"
        )

    # The snapshot the previous restart left (one run behind), then what compacting the last run reads.
    # (built from what the generator wrote, not read: reading all but one run would take as long as the full read)
    prefix, last = f"l{ranks}x{runs}", f"job{runs - 1:04d}"
    epochs, shards = generated(ranks, runs - 1)
    commits = {f"job{r:04d}": dict.fromkeys(range(ranks), 2) for r in range(runs - 1)}
    behind_runs = summaries(prefix, ranks, runs - 1)
    write_snapshot(Snapshot(path, *marks[-2], epochs, shards, ranks=commits, runs=behind_runs))  # type: ignore[arg-type]
    behind = measure(counter, lambda: new_read(path, lineage, steps, use_snapshots=True))
    assert behind["result"].files_read == ranks and behind["result"].snapshot is not None
    print(
        f"no snapshot of the watermark (compact, or rank 0 without torch.distributed): {behind['s']:.2f} s "
        f"({behind['cpu']:.1f} s CPU), {behind['reads']:,} requests "
        f"{behind['requests']}, {behind['bytes'] / 1e6:.1f} MB, peak +{behind['mib']:.0f} MiB",
        flush=True,
    )
    count = behind["result"].epochs[0].count()
    assert behind["result"].epochs[0].samples == generated(ranks, runs)[0][0].samples  # (exact, checked)

    # Under torch.distributed: rank 0's work at each of the last run's 2 checkpoints (what every rank sends it
    # is built here; the gather itself is a collective of a few kB per rank), from what resume read.
    base = new_read(path, *marks[-2], use_snapshots=True)
    chain = SnapshotChain(path, last)
    files = [rank_file_of(prefix, runs - 1, k, ranks, *marks[-2]) for k in range(ranks)]
    seen: list[set[int]] = [set() for _ in files]
    for number, step in ((1, 100), (2, 200)):
        received = []
        for f in files:
            new = f.commits[number - 1 : number]
            entries = commit_entries(new, seen[f.rank])
            received.append(msgpack.packb([f.rank, f.world_size, new, [f.size, number, entries, f.parents()]]))
        mark = {"lineage": {**marks[-2][0], last: number}, "steps": {**marks[-2][1], last: step}}
        gathered = measure(counter, lambda: chain._advance(received, mark, base))  # noqa: B023
    assert chain.last_url is not None and not chain.broken
    print(
        f"new, rank 0 at a checkpoint (adds {ranks:,} ranks' commits, writes the snapshot): {gathered['s']:.2f} s "
        f"({gathered['cpu']:.1f} s CPU), {gathered['reads']} requests {gathered['requests']}, "
        f"{gathered['bytes'] / 1e6:.1f} MB, peak +{gathered['mib']:.0f} MiB",
        flush=True,
    )

    rounds = [measure(counter, lambda: new_read(path, lineage, steps, use_snapshots=True)) for _ in range(args.repeats)]
    assert all(r["result"].files_read == 0 and r["result"].epochs[0].count() == count for r in rounds)
    assert rounds[0]["result"].snapshot.url == chain.last_url  # (the one written at the checkpoint)
    rank = statistics.median(r["s"] for r in rounds)
    one = rounds[-1]
    print(
        f"new, a rank's resume (the snapshot of its checkpoint): {rank * 1000:.0f} ms median of {args.repeats} "
        f"({min(r['s'] for r in rounds) * 1000:.0f}-{max(r['s'] for r in rounds) * 1000:.0f}), "
        f"{one['reads']} requests {one['requests']}, {one['bytes'] / 1e6:.1f} MB, peak +{one['mib']:.0f} MiB; "
        f"object reads per restart: {one['reads']} with torch.distributed (rank 0), {ranks:,} ranks x "
        f"{one['reads']} = {ranks * one['reads']:,} without it (after ledger compact: +{behind['reads']:,})",
        flush=True,
    )

    shown = [measure(counter, lambda: _show(path)) for _ in range(2)]
    best = min(shown, key=lambda r: r["s"])
    print(
        f"ledger show (the snapshot written last, the newest run's listing): {best['s']:.2f} s "
        f"(best of 2; {best['cpu']:.1f} s CPU), {best['reads']} requests {best['requests']}, "
        f"{best['bytes'] / 1e6:.1f} MB, peak +{best['mib']:.0f} MiB",
        flush=True,
    )
    return full_per_file


def _show(path: str) -> None:
    from wdsraft.cli import main as cli

    with redirect_stdout(io.StringIO()), redirect_stderr(io.StringIO()):  # (and its progress bar)
        cli(["ledger", "show", path])


if __name__ == "__main__":
    main()
