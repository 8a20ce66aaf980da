"""Interrupts: `specdec data generate` and `specdec train` stopped by SIGINT, SIGTERM or SIGKILL at chosen and at
seeded random moments, then resumed, end with exactly the data and the weights of a run never stopped.

The stopped runs are real processes (a small driver runs the CLI with a hook that counts the target's
`generate` calls, or the draft's loss calls, prints a line after each, and can signal its own process at a
given call: a deterministic moment); resumes and the uninterrupted references run in this process. Everything
uses one thread, so the two processes compute bit for bit the same numbers.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from conftest import tiny_model, tiny_tokenizer
from safetensors.torch import load_file

from specdec.cli import main
from specdec.training.data import DataDir, generate_data, prompt_key
from specdec.training.interrupts import Interrupted

DRIVER = r"""
import json, os, sys, time
import torch
torch.set_num_threads(1)
from specdec import loading

hook = json.loads(os.environ["SPECDEC_TEST_HOOK"])
calls = 0


def tick():
    global calls
    calls += 1
    if calls == hook.get("signal_at"):
        os.kill(os.getpid(), hook["signal"])
    time.sleep(hook.get("sleep", 0.0))


def done():
    print("finished", calls, flush=True)


real_load = loading.load_model


def load_model(*args, **kwargs):
    model, tokenizer = real_load(*args, **kwargs)
    real_generate = model.generate

    def generate(*a, **k):
        tick()
        out = real_generate(*a, **k)
        done()
        return out

    model.generate = generate
    print("ready", flush=True)
    return model, tokenizer


loading.load_model = load_model
if hook.get("train"):
    from specdec_dflash.training import DFlashObjective

    real_loss = DFlashObjective.batch_loss

    def batch_loss(self, *a, **k):
        tick()
        out = real_loss(self, *a, **k)
        done()
        return out

    DFlashObjective.batch_loss = batch_loss

from specdec.cli import main

main(sys.argv[1:], prog_name="specdec")
"""

BATCH = 2
PROMPTS = 12


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class Driven:
    """The CLI in a subprocess under the driver; `lines` collects what it prints, as it prints it."""

    def __init__(self, root: Path, args: list[str], hook: dict) -> None:
        driver = root / "driver.py"
        driver.write_text(DRIVER)
        env = {**os.environ, "SPECDEC_TEST_HOOK": json.dumps(hook), "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen([sys.executable, str(driver), *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=env)
        self.lines: list[str] = []
        self.stderr = ""
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.strip())

    def finished(self) -> int:
        return sum(line.startswith("finished") for line in self.lines)

    def wait_for(self, count: int, timeout: float = 120) -> None:
        """Until `count` calls have finished (or the process ended)."""
        deadline = time.monotonic() + timeout
        while self.finished() < count and self.proc.poll() is None:
            assert time.monotonic() < deadline, self.lines
            time.sleep(0.005)

    def wait(self) -> int:
        code = self.proc.wait(timeout=300)
        self._reader.join(timeout=10)
        self.stderr = self.proc.stderr.read()
        return code


@pytest.fixture(scope="module")
def gen_setup(tmp_path_factory):
    """(root, a tiny target folder whose EOS is w1, a prompts file of 12 prompts of one length)."""
    root = tmp_path_factory.mktemp("interrupts")
    model = tiny_model("llama", seed=5, dtype=torch.float32)
    model.generation_config.eos_token_id = 1
    model.generation_config.pad_token_id = 1
    model.save_pretrained(root / "model")
    tiny_tokenizer().save_pretrained(root / "model")
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"w{10 + i} w{40 + i}"}) + "\n" for i in range(PROMPTS)))
    return root, str(root / "model"), str(prompts)


def gen_args(setup, out, *extra: str) -> list[str]:
    root, model_dir, prompts = setup
    return ["data", "generate", "--prompts", prompts, "--out", str(out), "--model", model_dir, "--dtype", "float64",
            "--batch-size", str(BATCH), "--max-new-tokens", "8", *extra]


def examples(out) -> dict[str, tuple[list[int], list[int]]]:
    """id -> (tokens, loss mask) of a data directory; no id twice."""
    index = DataDir(out).read_index()
    ids = [i for shard in index["shards"] for i in shard["ids"]]
    assert len(ids) == len(set(ids)), "an example was written twice"
    return {i: (t.tolist(), m.int().tolist()) for i, (t, m) in zip(ids, DataDir(out).sequences(), strict=True)}


@pytest.fixture(scope="module")
def reference_data(gen_setup):
    root = gen_setup[0]
    result = CliRunner().invoke(main, gen_args(gen_setup, root / "reference"))
    assert result.exit_code == 0, result.output
    data = examples(root / "reference")
    assert len(data) == PROMPTS
    assert set(data) == {prompt_key(f"w{10 + i} w{40 + i}") for i in range(PROMPTS)}
    return data


def resume_data(setup, out):
    result = CliRunner().invoke(main, gen_args(setup, out))
    assert result.exit_code == 0, result.output
    return examples(out)


def test_generate_sigint_keeps_every_finished_prompt_and_resumes_to_the_same_data(gen_setup, reference_data):
    """The issue's case: Ctrl-C after 4 of 12 prompts, long before any flush is due, keeps those 4."""
    out = gen_setup[0] / "sigint"
    run = Driven(gen_setup[0], gen_args(gen_setup, out), {"signal_at": 3, "signal": int(signal.SIGINT)})
    assert run.wait() == 130, run.stderr
    assert "interrupted by SIGINT: 4 finished sequences are saved" in run.stderr
    assert "Traceback" not in run.stderr
    kept = examples(out)
    assert len(kept) == 2 * BATCH  # calls 1 and 2 finished; call 3 was in flight and is dropped
    assert all(reference_data[i] == seq for i, seq in kept.items())
    assert resume_data(gen_setup, out) == reference_data


def test_generate_sigterm_in_process_keeps_the_finished_batches(tmp_path):
    """The library call: SIGTERM during the 4th batch raises Interrupted (exit code 143) after writing 3 batches."""
    model = tiny_model("llama", seed=5, dtype=torch.float64)
    model.generation_config.eos_token_id = 1
    tokenizer = tiny_tokenizer()
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"w{10 + i} w{60 + i}"}) + "\n" for i in range(10)))
    kwargs = dict(max_new_tokens=6, batch_size=2, progress=False)
    reference = generate_data(model, tokenizer, "tiny", [str(prompts)], tmp_path / "ref", **kwargs)
    assert sum(len(s["ids"]) for s in reference["shards"]) == 10
    real, calls = model.generate, []

    def generate(*args, **kw):
        calls.append(1)
        if len(calls) == 4:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(*args, **kw)

    model.generate = generate
    handler_before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Interrupted) as stop:
        generate_data(model, tokenizer, "tiny", [str(prompts)], tmp_path / "cut", **kwargs)
    assert stop.value.exit_code == 143 and "SIGTERM: 6 finished sequences" in stop.value.message
    assert signal.getsignal(signal.SIGTERM) == handler_before  # the handlers are put back
    assert len(examples(tmp_path / "cut")) == 6
    model.generate = real
    generate_data(model, tokenizer, "tiny", [str(prompts)], tmp_path / "cut", **kwargs)
    assert examples(tmp_path / "cut") == examples(tmp_path / "ref")


def test_generate_sigkill_at_random_moments_loses_at_most_the_last_flush(gen_setup, reference_data):
    """SIGKILL (nothing can be caught) after a seeded random number of batches, twice, with a flush after every
    batch: what is on disk is every batch but the one being written, and the resumed data is the reference."""
    rng = random.Random(25)
    out = gen_setup[0] / "sigkill"
    for _attempt in range(2):
        before = len(examples(out)) if DataDir(out).exists() else 0
        remaining = (PROMPTS - before) // BATCH
        run = Driven(gen_setup[0], gen_args(gen_setup, out, "--flush-seconds", "0"), {"sleep": 0.05})
        run.wait_for(rng.randint(1, max(1, remaining - 1)))
        time.sleep(rng.uniform(0.0, 0.05))
        run.proc.kill()
        code = run.wait()
        assert code == -signal.SIGKILL or (code == 0 and len(examples(out)) == PROMPTS), run.stderr
        finished = run.finished()
        kept = examples(out)
        assert all(reference_data[i] == seq for i, seq in kept.items())
        new = len(kept) - before
        assert (finished - 1) * BATCH <= new <= finished * BATCH, (finished, new)
    assert resume_data(gen_setup, out) == reference_data


# -- train ---------------------------------------------------------------------------------------------------

STEPS = 8


def train_args(setup, run, *extra: str) -> list[str]:
    """Every run starts from one saved draft (a new draft's random init differs from process to process)."""
    root, model_dir, data_dir = setup
    return ["train", "--proposer", "dflash", "--model", model_dir, "--data", data_dir, "--out", str(run),
            "--dtype", "float32", "--init", str(root / "init-draft"), "--opt", "num_anchors=8", "--lr", "3e-3",
            "--save-every", "3", "--eval-prompts", "1", "--steps", str(STEPS), "--no-progress", *extra]


def outcome(run: Path) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """(trainer tensors, history without timings) of a finished run."""
    state = json.loads((run / "trainer_state.json").read_text())
    history = [{k: v for k, v in h.items() if k not in ("tokens_per_second", "elapsed_seconds")}
               for h in state["history"]]
    assert state["step"] == STEPS
    return load_file(run / "trainer_state.safetensors"), history


def assert_same_run(run: Path, reference: Path) -> None:
    tensors, history = outcome(run)
    ref_tensors, ref_history = outcome(reference)
    assert history == ref_history
    assert tensors.keys() == ref_tensors.keys()
    for key, value in ref_tensors.items():
        assert torch.equal(tensors[key], value), key
    draft = load_file(run / "draft" / "model.safetensors")
    ref_draft = load_file(reference / "draft" / "model.safetensors")
    assert draft.keys() == ref_draft.keys() and all(torch.equal(draft[k], v) for k, v in ref_draft.items())


@pytest.fixture(scope="module")
def reference_run(tiny_setup):
    from specdec import TargetModel
    from specdec_dflash.training import DFlashObjective

    target = TargetModel(tiny_model("llama", seed=4), tiny_tokenizer())  # the shape of tiny_setup's target
    config = DFlashObjective.Config(num_layers=1, block_size=4, mask_token_id=4)
    DFlashObjective(config, target).save_draft(tiny_setup[0] / "init-draft")
    run = tiny_setup[0] / "reference-run"
    result = CliRunner().invoke(main, train_args(tiny_setup, run))
    assert result.exit_code == 0, result.output
    assert [h["step"] for h in outcome(run)[1]] == [3, 6, 8]
    return run


def test_train_sigint_saves_the_step_and_resumes_to_the_same_weights(tiny_setup, reference_run):
    """SIGINT during step 5's second sequence (loss call 10): step 5 ends, is saved, exit 130; --resume finishes
    with the weights and history of the run never stopped (anchor sampler state and the progress average
    included)."""
    run = tiny_setup[0] / "sigint-run"
    driven = Driven(tiny_setup[0], train_args(tiny_setup, run), {"train": True, "signal_at": 10,
                                                                  "signal": int(signal.SIGINT)})
    assert driven.wait() == 130, driven.stderr
    assert "interrupted by SIGINT at step 5" in driven.stderr and "--resume" in driven.stderr
    state = json.loads((run / "trainer_state.json").read_text())
    assert state["step"] == 5 and [h["step"] for h in state["history"]] == [3]  # no record for the stop itself
    result = CliRunner().invoke(main, train_args(tiny_setup, run, "--resume"))
    assert result.exit_code == 0, result.output
    assert_same_run(run, reference_run)


def test_train_sigkill_at_a_random_moment_resumes_to_the_same_weights(tiny_setup, reference_run):
    """SIGKILL after a seeded random number of loss calls (maybe mid-checkpoint): the run resumes from its last
    whole checkpoint (or starts again when none was written) and ends as the run never stopped."""
    rng = random.Random(7)
    run = tiny_setup[0] / "sigkill-run"
    driven = Driven(tiny_setup[0], train_args(tiny_setup, run), {"train": True, "sleep": 0.01})
    driven.wait_for(rng.randint(7, 2 * STEPS - 2))
    time.sleep(rng.uniform(0.0, 0.05))
    driven.proc.kill()
    assert driven.wait() == -signal.SIGKILL
    resumable = (run / "trainer_state.safetensors").is_file()
    result = CliRunner().invoke(main, train_args(tiny_setup, run, *(["--resume"] if resumable else [])))
    assert result.exit_code == 0, result.output
    assert_same_run(run, reference_run)
    assert not list(run.glob(".draft-*")) and not list(run.glob("*.tmp"))
