"""Concurrent generate calls: serialised, so each output is the one a single-threaded run gives."""

from __future__ import annotations

import threading

from conftest import tiny_model

from specdec import SpeculativeDecoder

PROMPTS = [[2, 5, 9, 5, 9, 5], [3, 3, 3, 7], [11, 4, 8, 15, 16, 23, 42]]


def test_four_threads_times_three_prompts_match_the_single_threaded_outputs():
    model = tiny_model("llama", seed=3)
    # two decoders over one model object (they share its tap hooks and weights), greedy and sampled
    decoders = [SpeculativeDecoder.from_model(model, proposer="ngram", num_tokens=4),
                SpeculativeDecoder.from_model(model, proposer="autoregressive", cache="dynamic")]
    jobs = [(d, p, t) for d in range(2) for p in range(3) for t in (0.0, 0.8)]

    def run(job):
        d, p, temperature = job
        return decoders[d].generate_ids(PROMPTS[p], max_new_tokens=24, temperature=temperature, seed=p).token_ids

    expected = {job: run(job) for job in jobs}
    results: dict[tuple[int, tuple], list[int]] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(4)

    def worker(w: int) -> None:
        start.wait()
        try:
            for i in range(3):  # 4 threads x 3 prompts, each thread its own order through the jobs
                job = jobs[(w * 3 + i * 5) % len(jobs)]
                results[(w, job)] = run(job)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    assert len(results) == 12
    for (_, job), tokens in results.items():
        assert tokens == expected[job], job
