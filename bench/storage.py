"""Files and batches at OpenAI's scale (issue 34, items 1 and 2), in one command:

    python -m bench.storage                 # the four parts below, about 4 minutes; prints a table
    python -m bench.storage --record        # and writes bench/results/storage-<time>.{md,json}

(a) Uploads beside interactive load. One sim device (100 ms batches). Another tenant's open-loop Poisson load
    at 30 req/s on /v1/inference (anonymous, `bench.loadgen`) is measured alone, then again while an API-key
    tenant keeps three 59 MB uploads (curl processes, `-F file=@...`) in progress for the whole window, each
    file deleted once uploaded. Reported: the load's p95 both times and their ratio (goal: within 1.25x) and
    the server's RSS at the start and its peak (goal: within 200 MB of the start).
(b) The upload -> batch -> cancel -> delete loop, five rounds of the same 59 MB file, under
    `--tenant-storage-mb` (150 by default): per round the answers, the bytes the tenant keeps (read from the
    job store) and the store's size on disk; then the batches are deleted. Goal: never over the quota.
(c) A 2,048-input embeddings batch's output, served to six concurrent GETs. The embeddings come from a plugin
    that returns 384 floats per input (minilm's width, with ~19 digits each: no model to load on 2 cores),
    64 lines of 32 inputs. Reported: the output file's size and the server's RSS growth during the GETs
    (goal: under 100 MB).
(d) Slow readers of an output of huge lines: 4 lines of 2,048 inputs each (~16 MB a line, ~63 MB in all, from a
    ~0.07 MB input file), the same plugin, read by `--readers` (32) concurrent GETs at about 10 MB/s each.
    Reported: the server's RSS growth during the GETs, per reader (goal: a few MB: a page of 1 MiB and a piece).

Servers are stopped by PID on success, error or Ctrl-C. The machine is shared and noisy: the load average is
reported with each part; quote ratios from one run.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as `python bench/storage.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse
import os
import shutil
import sqlite3
import subprocess
import tempfile
import threading
import time

import httpx
import orjson

from bench import common, report, servers
from bench.loadgen import measure
from bench.procstat import RssWatch

MB = 1_000_000
PLUGIN = '''
class Vectors:
    """384 floats per input, each with many digits (as a real model's): a large output, no model to load."""

    output_kind = "embedding"
    max_batch_size = 64

    def batch(self, inputs):
        return [[((i * 7919 + j * 104729) % 1000003) / 1000003.123456789 for j in range(384)]
                for i, _ in enumerate(inputs)]
'''


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def input_file(path: Path, size: int, endpoint: str = "/v1/inference") -> int:
    """A JSONL input file of about `size` bytes (lines of ~1.3 kB); its line count."""
    n = 0
    with path.open("wb") as fh:
        written = 0
        while written < size:
            line = (
                orjson.dumps(
                    {
                        "custom_id": f"r{n}",
                        "method": "POST",
                        "url": endpoint,
                        "body": {"input": f"line {n} " + "word " * 250},
                    }
                )
                + b"\n"
            )
            fh.write(line)
            written += len(line)
            n += 1
    return n


def curl_upload(base: str, path: Path, key: str) -> tuple[int, dict]:
    out = subprocess.run(
        [
            "curl",
            "-sS",
            "-H",
            f"Authorization: Bearer {key}",
            "-F",
            "purpose=batch",
            "-F",
            f"file=@{path}",
            "-w",
            "\n%{http_code}",
            base + "/v1/files",
        ],
        capture_output=True,
        timeout=300,
    )
    body, _, code = out.stdout.rpartition(b"\n")
    try:
        return int(code), orjson.loads(body)
    except (ValueError, orjson.JSONDecodeError):
        return int(code or 0), {"error": out.stderr.decode(errors="replace")[-200:]}


def start(
    name: str, a: argparse.Namespace, work: Path, extra: list[str], env: dict[str, str] | None = None
) -> servers.Server:
    cmd = servers.batchserve_cmd(1, a.sim_batch_ms, 100, ["--jobs-db", str(work / f"{name}.db"), *extra])
    return servers.start(name, cmd, common.log_dir(a, name) if common.out_dir(a) else work / "logs", env=env)


# -- (a) ---------------------------------------------------------------------------------------------------------
def part_a(a: argparse.Namespace, work: Path) -> dict:
    config = work / "a.toml"
    config.write_text("")
    key = servers.add_key(config, "uploader", "enterprise")
    server = start("storage-a", a, work, ["--config", str(config), "--allow-anonymous", "--slo-ms", "200"])
    base = server.base
    big = work / "upload.jsonl"
    input_file(big, int(a.upload_mb * MB))
    base_load = measure(base, a.rate, a.duration, a.warmup, a.seed, server_pid=server.pid)
    stop = threading.Event()
    uploads: list[tuple[int, float]] = []

    def uploader() -> None:
        with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=60) as h:
            while not stop.is_set():
                t0 = time.monotonic()
                code, body = curl_upload(base, big, key)
                uploads.append((code, time.monotonic() - t0))
                if code == 200:
                    h.delete(f"/v1/files/{body['id']}")

    with RssWatch(server.pid) as rss:
        threads = [threading.Thread(target=uploader) for _ in range(3)]
        for t in threads:
            t.start()
        loaded = measure(base, a.rate, a.duration, a.warmup, a.seed, server_pid=server.pid)
        stop.set()
        for t in threads:
            t.join()
    servers.stop(server)
    ok = [s for code, s in uploads if code == 200]
    return {
        "rate": a.rate,
        "upload_mb": a.upload_mb,
        "baseline_p95_ms": base_load.p95_ms,
        "with_uploads_p95_ms": loaded.p95_ms,
        "p95_ratio": loaded.p95_ms / base_load.p95_ms,
        "baseline_errors": base_load.error_count,
        "with_uploads_errors": loaded.error_count,
        "uploads_ok": len(ok),
        "uploads_refused": len(uploads) - len(ok),
        "upload_s_median": sorted(ok)[len(ok) // 2] if ok else None,
        "rss_start_mb": rss.start_mb,
        "rss_peak_mb": rss.peak_mb,
        "rss_growth_mb": rss.growth_mb,
        "loadavg": loadavg(),
    }


# -- (b) ---------------------------------------------------------------------------------------------------------
def kept(db: Path) -> int:
    conn = sqlite3.connect(db)
    try:
        return int(
            conn.execute(
                "SELECT (SELECT COALESCE(SUM(bytes), 0) FROM files) + (SELECT COALESCE(SUM(bytes), 0) FROM jobs)"
            ).fetchone()[0]
        )
    finally:
        conn.close()


def on_disk(db: Path) -> int:
    return sum(p.stat().st_size for p in db.parent.glob(db.name + "*"))


def part_b(a: argparse.Namespace, work: Path) -> dict:
    server = start("storage-b", a, work, ["--tenant-storage-mb", f"{a.quota_mb:g}"])
    db = work / "storage-b.db"
    big = work / "upload.jsonl"
    if not big.exists():
        input_file(big, int(a.upload_mb * MB))
    rounds = []
    with httpx.Client(base_url=server.base, timeout=120) as h:
        for i in range(5):
            code, body = curl_upload(server.base, big, "-")
            row: dict = {"round": i + 1, "upload": code}
            if code == 200:
                t0 = time.monotonic()
                made = h.post(
                    "/v1/batches",
                    json={"input_file_id": body["id"], "endpoint": "/v1/inference", "completion_window": "24h"},
                )
                row["batch"] = made.status_code
                row["batch_s"] = time.monotonic() - t0
                if made.status_code == 202:
                    row["cancel"] = h.post(f"/v1/batches/{made.json()['id']}/cancel").status_code
                else:
                    row["why"] = made.json().get("message", "")[:90]
                row["delete"] = h.delete(f"/v1/files/{body['id']}").status_code
            else:
                row["why"] = str(body.get("message", body.get("error", "")))[:90]
            row["kept_mb"] = kept(db) / MB
            row["disk_mb"] = on_disk(db) / MB
            rounds.append(row)
        for b in h.get("/v1/batches").json()["data"]:
            h.delete(f"/v1/batches/{b['id']}")
        after = {"kept_mb": kept(db) / MB, "disk_mb": on_disk(db) / MB}
    servers.stop(server)
    return {
        "quota_mb": a.quota_mb,
        "upload_mb": a.upload_mb,
        "rounds": rounds,
        "max_kept_mb": max(r["kept_mb"] for r in rounds),
        "after_deleting_batches": after,
        "loadavg": loadavg(),
    }


# -- (c) ---------------------------------------------------------------------------------------------------------
def vectors_output(
    a: argparse.Namespace, work: Path, name: str, lines: int, inputs: int
) -> tuple[servers.Server, dict]:
    """A server of the Vectors plugin that has run an embeddings batch of `lines` lines of `inputs` inputs: the
    server (to stop) and what the batch made (its output file's id and size, its status, its run time)."""
    (work / "vecplug.py").write_text(PLUGIN)
    config = work / f"{name}.toml"
    config.write_text('[[models]]\nname = "vec"\nbackend = "vecplug:Vectors"\n')
    env = {"PYTHONPATH": os.pathsep.join([str(work), str(servers.REPO)])}
    server = start(name, a, work, ["--config", str(config), "--slo-ms", "2000", "--timeout-ms", "60000"], env=env)
    content = b"".join(
        orjson.dumps(
            {
                "custom_id": f"r{i}",
                "method": "POST",
                "url": "/v1/embeddings",
                "body": {"model": "vec", "input": [f"t{j}" for j in range(inputs)]},
            }
        )
        + b"\n"
        for i in range(lines)
    )
    with httpx.Client(base_url=server.base, timeout=120) as h:
        file_id = h.post("/v1/files", files={"file": ("in.jsonl", content)}, data={"purpose": "batch"}).json()["id"]
        batch = h.post(
            "/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/embeddings", "completion_window": "24h"}
        ).json()
        t0 = time.monotonic()
        while (b := h.get(f"/v1/batches/{batch['id']}").json())["status"] == "in_progress":
            time.sleep(0.2)
        run_s = time.monotonic() - t0
        out_id = b["output_file_id"]
        size = h.get(f"/v1/files/{out_id}").json()["bytes"]
    return server, {
        "out_id": out_id,
        "size": size,
        "status": b["status"],
        "batch_s": run_s,
        "input_mb": len(content) / MB,
    }


def concurrent_gets(
    server: servers.Server, out_id: str, readers: int, bytes_per_s: float | None
) -> tuple[list[int], RssWatch, float]:
    """`readers` GETs of the file at once (each at most `bytes_per_s`, when given): bytes each got, the server's
    RSS meanwhile, seconds."""
    got: list[int] = []

    def fetch() -> None:
        n, t0 = 0, time.monotonic()
        with httpx.Client(base_url=server.base, timeout=300) as c, c.stream("GET", f"/v1/files/{out_id}/content") as r:
            for chunk in r.iter_bytes(64 << 10):
                n += len(chunk)
                if bytes_per_s and (ahead := n / bytes_per_s - (time.monotonic() - t0)) > 0:
                    time.sleep(ahead)
        got.append(n)

    time.sleep(1.0)  # let the batch's own allocations settle before the baseline sample
    with RssWatch(server.pid) as rss:
        t0 = time.monotonic()
        threads = [threading.Thread(target=fetch) for _ in range(readers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    return got, rss, time.monotonic() - t0


def part_c(a: argparse.Namespace, work: Path) -> dict:
    server, made = vectors_output(a, work, "storage-c", 64, 32)
    try:
        got, rss, gets_s = concurrent_gets(server, made["out_id"], 6, None)
    finally:
        servers.stop(server)
    return {
        "inputs": 2048,
        "lines": 64,
        "status": made["status"],
        "batch_s": made["batch_s"],
        "output_mb": made["size"] / MB,
        "gets": 6,
        "each_got_all": all(n == made["size"] for n in got),
        "gets_s": gets_s,
        "rss_start_mb": rss.start_mb,
        "rss_peak_mb": rss.peak_mb,
        "rss_growth_mb": rss.growth_mb,
        "output": "plugin vecplug:Vectors (384 floats per input, no model)",
        "loadavg": loadavg(),
    }


# -- (d) ---------------------------------------------------------------------------------------------------------
def part_d(a: argparse.Namespace, work: Path) -> dict:
    server, made = vectors_output(a, work, "storage-d", 4, 2048)
    try:
        got, rss, gets_s = concurrent_gets(server, made["out_id"], a.readers, 10 * MB)
    finally:
        servers.stop(server)
    return {
        "inputs": 4 * 2048,
        "lines": 4,
        "input_mb": made["input_mb"],
        "status": made["status"],
        "batch_s": made["batch_s"],
        "output_mb": made["size"] / MB,
        "readers": a.readers,
        "each_got_all": all(n == made["size"] for n in got) and len(got) == a.readers,
        "gets_s": gets_s,
        "rss_start_mb": rss.start_mb,
        "rss_peak_mb": rss.peak_mb,
        "rss_growth_mb": rss.growth_mb,
        "rss_per_reader_mb": rss.growth_mb / a.readers,
        "loadavg": loadavg(),
    }


def markdown(rep: dict) -> str:
    a, b, c, d = rep.get("a"), rep.get("b"), rep.get("c"), rep.get("d")
    rows = []
    if a:
        rows += [
            [
                "(a) other tenant's p95, baseline / with 3 uploads",
                f"{a['baseline_p95_ms']:.0f} / {a['with_uploads_p95_ms']:.0f} ms",
                f"{a['p95_ratio']:.2f}x",
                "≤ 1.25x",
            ],
            [
                "(a) server RSS start / peak",
                f"{a['rss_start_mb']:.0f} / {a['rss_peak_mb']:.0f} MB",
                f"+{a['rss_growth_mb']:.0f} MB",
                "≤ +200 MB",
            ],
            [
                "(a) uploads done / refused, median s",
                f"{a['uploads_ok']} / {a['uploads_refused']}",
                report.fmt(a["upload_s_median"], ".1f"),
                "",
            ],
        ]
    if b:
        rows += [
            [
                "(b) tenant's bytes, most over 5 rounds",
                f"{b['max_kept_mb']:.1f} MB",
                f"quota {b['quota_mb']:g} MB",
                "≤ quota",
            ],
            [
                "(b) after deleting the batches: kept / on disk",
                f"{b['after_deleting_batches']['kept_mb']:.1f} / {b['after_deleting_batches']['disk_mb']:.1f} MB",
                "",
                "",
            ],
        ]
    if c:
        rows += [
            [
                "(c) 2,048-input output, 6 concurrent GETs",
                f"{c['output_mb']:.1f} MB each, all whole: {c['each_got_all']}",
                f"RSS +{c['rss_growth_mb']:.0f} MB",
                "< 100 MB",
            ]
        ]
    if d:
        rows += [
            [
                f"(d) {d['readers']} slow readers of {d['lines']} lines of 2,048 inputs ({d['input_mb']:.2f} MB in)",
                f"{d['output_mb']:.1f} MB each, all whole: {d['each_got_all']}",
                f"RSS +{d['rss_growth_mb']:.0f} MB, {d['rss_per_reader_mb']:.1f} MB a reader",
                "a few MB a reader",
            ]
        ]
    out = [f"# Storage bench ({rep['when_utc']})", "", report.table(["measure", "value", "result", "goal"], rows)]
    if b:
        out += [
            "",
            "Loop rounds (b):",
            "",
            report.table(
                ["round", "upload", "batch", "cancel", "delete", "kept MB", "on disk MB", "why"],
                [
                    [
                        r["round"],
                        r["upload"],
                        r.get("batch", "–"),
                        r.get("cancel", "–"),
                        r.get("delete", "–"),
                        f"{r['kept_mb']:.1f}",
                        f"{r['disk_mb']:.1f}",
                        r.get("why", ""),
                    ]
                    for r in b["rounds"]
                ],
            ),
        ]
    out += [
        "",
        f"Settings: {rep['settings']}",
        f"Machine: {rep['machine']}",
        f"Commit: {rep['git']}",
        "The machine is shared (2 cores, other sessions' work): load averages per part are in the JSON.",
    ]
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_load_flags(p, duration=20.0, warmup=3.0)
    p.add_argument("--sim-batch-ms", type=float, default=100.0)
    p.add_argument("--rate", type=float, default=30.0, help="the other tenant's req/s (default %(default)g)")
    p.add_argument("--upload-mb", type=float, default=59.0, help="size of each upload (default %(default)g)")
    p.add_argument("--quota-mb", type=float, default=150.0, help="--tenant-storage-mb in part (b)")
    p.add_argument("--parts", default="abcd", help="which parts to run (default abcd)")
    p.add_argument("--readers", type=int, default=32, help="concurrent slow readers in part (d) (default 32)")
    common.add_output_flags(p, name="storage")
    a = p.parse_args()
    name = common.run_name(a, "storage")
    rep: dict = {**report.provenance(), "settings": {k: v for k, v in vars(a).items() if k not in ("out_dir",)}}
    work = Path(tempfile.mkdtemp(prefix="bench-storage-"))
    try:
        with common.guarded(rep):
            for part, fn in (("a", part_a), ("b", part_b), ("c", part_c), ("d", part_d)):
                if part in a.parts:
                    print(f"part ({part}) ...", file=sys.stderr)
                    rep[part] = fn(a, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    md = markdown(rep)
    print(md)
    print(report.written(report.write(name, rep, md, common.out_dir(a))))


if __name__ == "__main__":
    main()
