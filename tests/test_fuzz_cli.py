"""Fuzzing the command line (issue 25): every subcommand (run, plugins, check, bench, data generate, train and
the plugin command export), driven with generated bad option values, argument lists and files (truncated and
corrupt weights, broken JSON and JSONL, bytes that are not UTF-8, existing output folders), must end in exactly
one `error:` line and exit code 2, print no traceback, and change no file outside a fresh output folder (the
input tree is hashed before and after every case).

Hypothesis draws the cases, derandomized, without an example database and without shrinking, so the file is
deterministic and stays within its time budget; CliRunner runs each case in-process on tiny models
(tests/conftest.py), and no case loads the embedded model.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from conftest import save_tiny_model, tiny_tokenizer, write_data
from hypothesis import HealthCheck, Phase, assume, given, settings
from hypothesis import strategies as st

from specdec.cli import main
from specdec.plugins import get_registry

#: every case is refused before work, so it is quick; no shrinking (a failure prints its example as drawn)
FUZZ = settings(max_examples=25, deadline=None, database=None, derandomize=True,
                phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
FEW = settings(FUZZ, max_examples=6)



# -- the world: tiny models, drafts, prompt files and a data directory, shared by every case -----------------

@dataclass
class World:
    root: Path
    model: str  # a tiny Llama target with a tokenizer (saved as a transformers folder)
    draft_lm: str  # a tiny causal LM sharing its tokenizer (the `draft` proposer)
    dflash: str  # a DFlash draft that fits the target
    prompts: str  # JSONL with `prompt`
    dataset_dir: str  # folder holding tiny.jsonl (bench --data-dir)
    data: str  # a training data directory for the target


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from specdec_dflash.checkpoint import save_draft
    from specdec_dflash.model import DFlashConfig, DFlashDraftModel

    root = tmp_path_factory.mktemp("fuzz")
    model = save_tiny_model(root / "model", seed=0, max_positions=64)
    draft_lm = save_tiny_model(root / "draft-lm", layers=1, seed=3, max_positions=64)
    config = DFlashConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=8, intermediate_size=48, mask_token_id=5, target_layer_ids=[1],
                          num_target_layers=4, vocab_size=128)
    save_draft(DFlashDraftModel(config), root / "dflash")
    lines = "".join(json.dumps({"id": str(i), "prompt": f"w{5 + i} w{6 + i}"}) + "\n" for i in range(3))
    (root / "prompts.jsonl").write_text(lines)
    (root / "datasets").mkdir()
    (root / "datasets" / "tiny.jsonl").write_text(lines)
    sequences = [([2, 5 + i, 3] + [6 + i + j for j in range(8)], [0, 0, 0] + [1] * 8) for i in range(4)]
    data = write_data(root / "train-data", tiny_tokenizer(), sequences)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SPECDEC_CACHE", str(root / "cache"))  # the embedded model's cache: never written
        yield World(root=root, model=model, draft_lm=draft_lm, dflash=str(root / "dflash"),
                    prompts=str(root / "prompts.jsonl"), dataset_dir=str(root / "datasets"), data=data)


# -- one case: a fresh folder for its inputs and output, the tree hashed around the command -----------------

def snapshot(roots: list[Path], skip: Path) -> dict[str, str]:
    """path -> sha256 of every file (and "dir" for every folder) under `roots`, except `skip` and below."""
    state: dict[str, str] = {}
    for root in roots:
        for folder, dirs, files in os.walk(root):
            here = Path(folder)
            if here == skip or skip in here.parents:
                dirs[:] = []
                continue
            state[str(here)] = "dir"
            for name in files:
                state[str(here / name)] = hashlib.sha256((here / name).read_bytes()).hexdigest()
    return state


class Case:
    """A scratch folder for one example's inputs; `out` is a fresh output folder that does not exist yet."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.dir = Path(tempfile.mkdtemp(prefix="case-", dir=world.root.parent))
        self.out = self.dir / "fresh-out"

    def __enter__(self) -> Case:
        return self

    def __exit__(self, *exc) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)

    def copy(self, source: str, name: str) -> Path:
        return Path(shutil.copytree(source, self.dir / name))

    def run(self, args: list[str], needles: tuple[str, ...] = ()) -> None:
        """Invoke the CLI; assert one `error:` line, exit code 2, no traceback, no input changed."""
        roots = [self.world.root, self.dir]
        before = snapshot(roots, skip=self.out)
        result = CliRunner().invoke(main, args)
        after = snapshot(roots, skip=self.out)
        shown = f"args: {args!r}\nexit code: {result.exit_code}\noutput:\n{result.output}"
        assert result.exception is None or isinstance(result.exception, SystemExit), \
            f"{shown}\nexception: {result.exception!r}"
        assert result.exit_code == 2, shown
        assert "Traceback" not in result.output, shown
        lines = [line for line in result.output.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("error: "), shown
        for needle in needles:
            assert needle in lines[0], f"{needle!r} not in the message\n{shown}"
        changed = sorted(set(before) ^ set(after) | {p for p in before if p in after and before[p] != after[p]})
        assert not changed, f"files outside the fresh output folder changed: {changed}\n{shown}"


# -- the commands: base arguments that would run, and valid extras that vary the argument lists -----------------

def base_args(command: str, world: World, case: Case) -> list[str]:
    out = str(case.out)
    return {
        "run": ["run", "--model", world.model, "-p", "ngram", "--max-new-tokens=2"],
        "plugins": ["plugins"],
        "check": ["check", "-p", "ngram", "--model", world.model, "--max-new-tokens=2", "--prompts", world.prompts],
        "bench": ["bench", "-d", "tiny", "--data-dir", world.dataset_dir, "--model", world.model, "-p", "ngram",
                  "--baselines", "none", "--max-new-tokens=2", "--no-progress", "--out", out],
        "data generate": ["data", "generate", "--prompts", world.prompts, "--out", out, "--model", world.model,
                          "--max-new-tokens=2"],
        "train": ["train", "-p", "dflash", "--data", world.data, "--out", out, "--model", world.model,
                  "--opt", "mask_token_id=4", "--steps=1", "--save-every=1", "--max-sequence-length=32",
                  "--eval-prompts=1", "--no-progress"],
        "export": ["export", "--draft", world.dflash, "--format", "zlab", "--out", out],
    }[command]


#: the positional argument a command takes last (run's PROMPT)
TAIL = {"run": ["w5 w6"]}

VALID_EXTRAS = {
    "run": [["--raw"], ["--json"], ["--top-k=5"], ["--top-p=0.9"], ["--seed=3"], ["--stop=w9"], ["--dtype=float32"],
            ["--cache=dynamic"], ["--device=cpu"], ["--temperature=0.5"]],
    "plugins": [["--json"]],
    "check": [["--json"], ["--dtype=float32"], ["--device=cpu"], ["--epsilon=0.5"]],
    "bench": [["--limit=1"], ["--seed=1"], ["--dtype=float32"], ["--device=cpu"], ["--epsilon=0.5"],
              ["--temperature=0.5"]],
    "data generate": [["--batch-size=2"], ["--limit=1"], ["--seed=1"], ["--dtype=float32"],
                      ["--max-prompt-tokens=16"]],
    "train": [["--lr=0.001"], ["--seed=1"], ["--dtype=float32"], ["--warmup-ratio=0.5"], ["--sequences-per-step=1"]],
    "export": [["--verifier=tiny"]],
}
COMMANDS = list(VALID_EXTRAS)


@pytest.mark.parametrize("command", COMMANDS)
def test_base_arguments_run(world, command):
    """Each command's base arguments, with every valid extra, do run: so each case below fails for its bad part."""
    with Case(world) as case:
        args = base_args(command, world, case) + [arg for group in VALID_EXTRAS[command] for arg in group]
        result = CliRunner().invoke(main, args + TAIL.get(command, []))
        assert result.exit_code == 0, (args, result.output, result.exception)


def extras(command: str) -> st.SearchStrategy[list[str]]:
    return st.lists(st.sampled_from(VALID_EXTRAS[command]), max_size=3, unique_by=lambda a: a[0].split("=")[0]).map(
        lambda groups: [arg for group in groups for arg in group])


def invoke(case: Case, command: str, data: st.DataObject, bad: list[str], needles: tuple[str, ...] = ()) -> None:
    """The command's base arguments, some valid extras, then the bad ones (later options win in click)."""
    args = base_args(command, case.world, case) + data.draw(extras(command), label="extras") + bad
    case.run(args + TAIL.get(command, []), needles)


# -- bad values ------------------------------------------------------------------------------------------------

def _parses(kind, text: str) -> bool:
    try:
        kind(text)
    except ValueError:
        return False
    return True


TEXT = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=12)
NOT_INT = TEXT.filter(lambda s: not _parses(int, s))
NOT_FLOAT = TEXT.filter(lambda s: not _parses(float, s))
BELOW_ONE = st.integers(-(2**70), 0).map(str)
NEGATIVE = st.integers(-(2**70), -1).map(str)
HUGE = st.integers(2**31, 2**80).map(str)  # specdec's own commands bound counts by 2**31 - 1
FLOAT_NEGATIVE = st.floats(max_value=-1e-6, allow_nan=False, allow_infinity=False).map(repr)
NON_FINITE = st.sampled_from(["nan", "inf", "-inf", "NaN", "Infinity"])
TEMPERATURE_BAD = NON_FINITE | FLOAT_NEGATIVE | NOT_FLOAT
TOP_P_BAD = (NON_FINITE | st.floats(max_value=0, allow_nan=False, allow_infinity=False).map(repr)
             | st.floats(min_value=1.0001, allow_nan=False, allow_infinity=False).map(repr))
EPSILON_BAD = NON_FINITE | st.floats(max_value=0, allow_nan=False, allow_infinity=False).map(repr) | NOT_FLOAT
SEED_BAD = NEGATIVE | st.integers(2**63, 2**90).map(str) | NOT_INT


def _bad_devices() -> list[str]:
    devices = ["tpu", "gpu", "cuda:-1", "cpu:x", "", "meta", "hpu", "mps", "xla", "cuda:0:1"]
    if torch.cuda.is_available():
        return devices + [f"cuda:{torch.cuda.device_count()}", "cuda:99"]
    return devices + ["cuda", "cuda:0", "cuda:7"]


DEVICE_BAD = st.sampled_from(_bad_devices())


def unknown_name(kind: str) -> st.SearchStrategy[str]:
    """A name no registered plugin of this kind has (the registry is read when a value is drawn)."""
    return TEXT.filter(lambda s: s.strip() and s not in getattr(get_registry(), kind))


def not_choice(*choices: str) -> st.SearchStrategy[str]:
    return TEXT.filter(lambda s: s not in choices)


DTYPES = ("auto", "float32", "bfloat16", "float16")
DTYPE_FREE_BAD = TEXT.filter(lambda s: s.strip() not in (*DTYPES, "float64"))
OPT_BAD = st.sampled_from(["num_tokens", "=3", "num_tokens=0", "num_tokens=abc", "num_tokens=-1", "speed=9",
                           " =1", "num_tokens=1.5"])
BENCH_OPT_BAD = st.sampled_from(["ngram.num_tokens=0", "ngram.num_tokens=x", "ngram.speed=9", "draft.num_tokens=2",
                                 "num_tokens=2", "ngram=2", ".x=1"])
CACHE_BAD = unknown_name("caches").filter(lambda s: s != "auto")


# -- bad files -------------------------------------------------------------------------------------------------

NOT_UTF8 = [b"\xff", b"\xfe\xfe", b"\xc3\x28", b"\xa0\xa1", b"\xe2\x28\xa1", b"\xf0\x28\x8c\xbc", b"\x80",
            b"\xed\xa0\x80"]


@dataclass
class FolderDamage:
    """A copy of a model or draft folder, damaged one way. `where` in [0, 1) places a cut or an insertion."""

    how: str
    where: float
    junk: bytes
    json_name: str = "config.json"

    def apply(self, case: Case, source: str) -> str:
        folder = case.copy(source, "damaged")
        weights = folder / "model.safetensors"
        data = weights.read_bytes()
        length = int.from_bytes(data[:8], "little")
        if self.how == "truncate":
            weights.write_bytes(data[: min(len(data) - 1, int(len(data) * self.where))])
        elif self.how == "header-length":
            bogus = len(data) + int(self.where * 2**40)
            weights.write_bytes(bogus.to_bytes(8, "little") + data[8:])
        elif self.how == "header-garbage":
            junk = (self.junk * (length // len(self.junk) + 1))[:length]
            weights.write_bytes(data[:8] + junk + data[8 + length:])
        elif self.how == "trailing-bytes":
            weights.write_bytes(data + self.junk)
        elif self.how == "json-truncate":
            file = folder / self.json_name
            text = file.read_bytes().rstrip()
            file.write_bytes(text[: int((len(text) - 1) * self.where)])
        elif self.how == "json-not-utf8":
            file = folder / self.json_name
            text = file.read_bytes()
            at = int(len(text) * self.where)
            file.write_bytes(text[:at] + NOT_UTF8[int(self.where * 997) % len(NOT_UTF8)] + text[at:])
        elif self.how == "json-not-object":
            (folder / self.json_name).write_text(json.dumps([1, 2]) if self.where < 0.5 else '"text"')
        elif self.how == "auto-map":  # remote code: must be refused, never imported
            config = json.loads((folder / "config.json").read_text())
            config["auto_map"] = {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"}
            (folder / "config.json").write_text(json.dumps(config))
            (folder / "evil.py").write_text(f"open({str(folder / 'pwned')!r}, 'w').write('ran')\n")
        elif self.how == "pickle-only":  # a pickle that would write a file if it were ever unpickled
            weights.unlink()
            payload = pickle.dumps(_Pwn(str(folder / "pwned")))
            (folder / "pytorch_model.bin").write_bytes(payload)
        elif self.how == "no-weights":
            weights.unlink()
        elif self.how == "no-config":
            (folder / "config.json").unlink()
        elif self.how == "missing-shard":
            index = {"metadata": {}, "weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}
            (folder / "model.safetensors.index.json").write_text(json.dumps(index))
        else:
            raise AssertionError(self.how)
        return str(folder)


class _Pwn:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


WEIGHT_DAMAGE = ["truncate", "header-length", "header-garbage", "trailing-bytes"]
JSON_DAMAGE = ["json-truncate", "json-not-utf8", "json-not-object"]


def folder_damage(hows: list[str], json_names: list[str]) -> st.SearchStrategy[FolderDamage]:
    return st.builds(FolderDamage, how=st.sampled_from(hows), where=st.floats(0, 0.999),
                     junk=st.binary(min_size=1, max_size=16), json_name=st.sampled_from(json_names))


TARGET_JSON = ["config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"]
TARGET_DAMAGE = folder_damage(WEIGHT_DAMAGE + JSON_DAMAGE + ["auto-map", "pickle-only", "no-weights", "no-config",
                                                             "missing-shard"], TARGET_JSON)
DFLASH_DAMAGE = folder_damage(WEIGHT_DAMAGE + ["json-truncate", "pickle-only", "no-weights", "no-config"],
                              ["config.json"])


@dataclass
class JsonlDamage:
    """A prompts (or dataset) JSONL file that cannot be read as prompts."""

    how: str
    where: float
    text: str

    def apply(self, case: Case) -> str:
        good = [json.dumps({"id": "a", "prompt": "w5 w6"}), json.dumps({"id": "b", "prompt": "w7 w8"})]
        path = case.dir / "bad.jsonl"
        if self.how == "not-utf8":
            raw = "\n".join(good).encode()
            at = int(len(raw) * self.where)
            path.write_bytes(raw[:at] + NOT_UTF8[int(self.where * 997) % len(NOT_UTF8)] + raw[at:] + b"\n")
        elif self.how == "truncated-line":
            line = good[1]
            path.write_text(good[0] + "\n" + line[: max(1, int((len(line) - 1) * self.where))] + "\n")
        elif self.how == "not-an-object":
            path.write_text(good[0] + "\n" + json.dumps([self.text]) + "\n")
        elif self.how == "surrogate":  # valid JSON, but the escape is no text a tokenizer can encode
            path.write_text(good[0] + "\n" + '{"id": "s", "prompt": "w5 \\udcff w6"}\n')
        elif self.how == "no-prompt":
            path.write_text(good[0] + "\n" + json.dumps({"id": "q", "question": self.text}) + "\n")
        elif self.how == "empty":
            path.write_text("\n" * int(self.where * 3))
        elif self.how == "utf16":
            path.write_bytes("\n".join(good).encode("utf-16"))
        else:
            raise AssertionError(self.how)
        return str(path)


JSONL_DAMAGE = st.builds(JsonlDamage, how=st.sampled_from(["not-utf8", "truncated-line", "not-an-object", "surrogate",
                                                           "no-prompt", "empty", "utf16"]),
                         where=st.floats(0, 0.999), text=TEXT)


# -- option values, per command --------------------------------------------------------------------------------

def p(command: str, option: str, values: st.SearchStrategy[str], *needles: str):
    return pytest.param(command, option, values, needles, id=f"{command}{option}")


OPTION_CASES = [
    p("run", "--max-new-tokens", BELOW_ONE | HUGE | NOT_INT, "--max-new-tokens"),
    p("run", "--temperature", TEMPERATURE_BAD),
    p("run", "--top-k", NEGATIVE | HUGE | NOT_INT, "--top-k"),
    p("run", "--top-p", TOP_P_BAD | NOT_FLOAT),
    p("run", "--seed", SEED_BAD, "--seed"),
    p("run", "--device", DEVICE_BAD),
    p("run", "--dtype", not_choice(*DTYPES), "--dtype"),
    p("run", "--cache", CACHE_BAD),
    p("run", "--opt", OPT_BAD),
    p("run", "--proposer", unknown_name("proposers"), "proposer"),
    p("run", "--verifier", unknown_name("verifiers"), "verifier"),
    p("run", "--model", st.sampled_from(["./no/such/folder", "/nonexistent/model.gguf"])),
    p("run", "--draft-budget", NEGATIVE | HUGE | NOT_INT.filter(lambda s: s.strip().lower() != "auto"),
      "--draft-budget"),
    p("run", "--batch-size", BELOW_ONE | HUGE | NOT_INT, "--batch-size"),
    p("run", "--prompts", st.sampled_from(["./no/such.jsonl", "/nonexistent.jsonl"]), "--prompts"),
    p("plugins", "--json", TEXT, "--json"),
    p("check", "--max-new-tokens", BELOW_ONE | HUGE | NOT_INT, "--max-new-tokens"),
    p("check", "--epsilon", EPSILON_BAD, "--epsilon"),
    p("check", "--device", DEVICE_BAD),
    p("check", "--dtype", not_choice(*DTYPES), "--dtype"),
    p("check", "--opt", OPT_BAD),
    p("check", "--proposer", unknown_name("proposers"), "proposer"),
    p("check", "--verifier", unknown_name("verifiers"), "verifier"),
    p("check", "--prompts", st.sampled_from(["./no/such.jsonl", "/nonexistent.jsonl"]), "does not exist"),
    p("bench", "--limit", BELOW_ONE | HUGE | NOT_INT, "--limit"),
    p("bench", "--max-new-tokens", BELOW_ONE | HUGE | NOT_INT, "--max-new-tokens"),
    p("bench", "--temperature", TEMPERATURE_BAD, "--temperature"),
    p("bench", "--seed", SEED_BAD, "--seed"),
    p("bench", "--epsilon", EPSILON_BAD, "--epsilon"),
    p("bench", "--device", DEVICE_BAD),
    p("bench", "--dtype", not_choice(*DTYPES), "--dtype"),
    p("bench", "--opt", BENCH_OPT_BAD),
    p("bench", "--cache", st.sampled_from(["ngram=paged", "nope=dynamic", "ngram", "=x"])),
    p("bench", "--baselines", TEXT.filter(lambda s: s.strip() and all(
        n.strip() not in ("", "none", "hf-greedy", "hf-pld") for n in s.split(","))), "baseline"),
    p("bench", "--proposers", TEXT.filter(lambda s: "," not in s and s.strip() and s.strip().partition(":")[0].strip()
                                          not in get_registry().proposers), "--proposers"),
    p("bench", "--dataset", st.sampled_from(["no-such-set", "./missing.jsonl", " "])),
    p("bench", "--draft-model", st.sampled_from(["./no/such/lm"]), "--draft-model"),
    p("bench", "--batch-size", BELOW_ONE | st.integers(1025, 2**80).map(str)
      | st.sampled_from(["x", "1,a", "4.5", "", " , ", "²"]), "--batch-size"),
    p("data generate", "--batch-size", BELOW_ONE | NOT_INT, "--batch-size"),
    p("data generate", "--max-new-tokens", BELOW_ONE | NOT_INT, "--max-new-tokens"),
    p("data generate", "--dtype", DTYPE_FREE_BAD, "dtype"),
    p("data generate", "--prompts", st.sampled_from(["./no/such.jsonl"]), "does not exist"),
    p("data generate", "--flush-seconds", NON_FINITE.filter(lambda s: "inf" not in s.lower()) | FLOAT_NEGATIVE,
      "--flush-seconds"),
    p("train", "--steps", BELOW_ONE | NOT_INT, "--steps"),
    p("train", "--sequences-per-step", BELOW_ONE, "--sequences-per-step"),
    p("train", "--sequences-per-forward", BELOW_ONE, "--sequences-per-forward"),
    p("train", "--save-every", BELOW_ONE, "--save-every"),
    p("train", "--warmup-ratio", st.floats(min_value=1.0001, allow_infinity=False).map(repr) | FLOAT_NEGATIVE,
      "--warmup-ratio"),
    p("train", "--dtype", DTYPE_FREE_BAD, "dtype"),
    p("train", "--cache", CACHE_BAD),
    p("train", "--proposer", unknown_name("proposers") | st.sampled_from(["ngram", "autoregressive"])),
    p("train", "--data", st.sampled_from(["./no/such/data"]), "data"),
    p("export", "--format", not_choice("zlab", "speculators", "vllm", "specforge"), "--format"),
    p("export", "--draft", st.sampled_from(["./no/such/draft"])),
]


@pytest.mark.parametrize("command,option,values,needles", OPTION_CASES)
@given(data=st.data())
@FUZZ
def test_bad_option_value(world, command, option, values, needles, data):
    value = data.draw(values, label="value")
    with Case(world) as case:
        invoke(case, command, data, [f"{option}={value}"], needles)


#: bad values that data generate and train once accepted (they ran, or failed with a traceback): fixed examples
ONCE_ACCEPTED = [
    ("data generate", "--max-prompt-tokens", ["0", "-3"]),
    ("data generate", "--temperature", ["nan", "inf", "-1"]),
    ("data generate", "--limit", ["0", "-2"]),
    ("train", "--lr", ["nan", "inf", "-1", "0"]),
    ("train", "--max-sequence-length", ["0", "-5"]),
    ("train", "--max-minutes", ["nan", "-1", "0"]),
    ("train", "--pause-at-minutes", ["nan", "inf", "-1", "0"]),
    ("train", "--eval-every", ["-1"]),
    ("train", "--eval-prompts", ["-1"]),
]


@pytest.mark.parametrize("command,option,value", [
    pytest.param(command, option, value, id=f"{command}{option}={value}")
    for command, option, values in ONCE_ACCEPTED for value in values])
def test_bad_option_value_once_accepted(world, command, option, value):
    with Case(world) as case:
        case.run(base_args(command, world, case) + [f"{option}={value}"], (option,))


# -- argument lists: unknown options, extra arguments, a flag given a value ------------------------------------

@pytest.mark.parametrize("command", [*COMMANDS, ""])
@given(data=st.data())
@FUZZ
def test_random_argument_lists(world, command, data):
    unknown = data.draw(st.from_regex(r"--zz[a-z-]{0,8}", fullmatch=True), label="unknown")
    junk = data.draw(st.lists(TEXT.filter(lambda s: not s.startswith("-")), max_size=2), label="junk")
    with Case(world) as case:
        if not command:  # the group itself
            case.run([unknown, *junk, "run", "w5"], ("--zz",))
            return
        args = base_args(command, world, case) + data.draw(extras(command), label="extras")
        boundaries = [i for i, arg in enumerate(args) if arg.startswith("-")] + [len(args)]  # never between an
        position = data.draw(st.sampled_from(boundaries), label="position")  # option and its value
        args[position:position] = [unknown, *junk]
        case.run(args + TAIL.get(command, []))


def test_extra_positional_arguments(world):
    for command in COMMANDS:
        with Case(world) as case:
            case.run(base_args(command, world, case) + TAIL.get(command, []) + ["surplus"], ("unexpected extra",))


# -- prompts on the command line ------------------------------------------------------------------------------------

@given(text=TEXT, byte=st.integers(0x80, 0xFF), where=st.floats(0, 1))
@FUZZ
def test_prompt_not_utf8(world, text, byte, where):
    """A prompt byte that is not UTF-8 reaches Python as a lone surrogate (surrogateescape)."""
    at = int(len(text) * where)
    prompt = "w5 " + text[:at] + chr(0xDC00 + byte) + text[at:]
    with Case(world) as case:
        case.run(["run", "--model", world.model, "-p", "ngram", prompt], ("not valid UTF-8", f"0x{byte:02x}"))


@given(blank=st.text(" \t\n\r", max_size=4))
@FEW
def test_blank_prompt(world, blank):
    with Case(world) as case:
        case.run(["run", "--model", world.model, blank], ("prompt is empty",))


@given(text=TEXT, byte=st.integers(0x80, 0xFF))
@FEW
def test_stop_string_not_utf8(world, text, byte):
    with Case(world) as case:
        case.run(["run", "--model", world.model, "--stop", text + chr(0xDC00 + byte), "w5"], ("--stop", "UTF-8"))


# -- damaged files -------------------------------------------------------------------------------------------

def _target_args(command: str, world: World, case: Case, model: str) -> list[str]:
    args = base_args(command, world, case) + TAIL.get(command, [])
    return [model if previous == "--model" else arg for previous, arg in zip([None, *args[:-1]], args, strict=True)]


@pytest.mark.parametrize("command", ["run", "check", "bench", "data generate", "train"])
@given(damage=TARGET_DAMAGE)
@settings(FUZZ, max_examples=40)
def test_damaged_target(world, command, damage):
    """Truncated or corrupt safetensors, broken JSON, remote code, pickle only: refused before transformers reads
    the folder, and nothing in it runs."""
    with Case(world) as case:
        folder = damage.apply(case, world.model)
        case.run(_target_args(command, world, case, folder))
        assert not (Path(folder) / "pwned").exists()


@given(damage=TARGET_DAMAGE)
@settings(FUZZ, max_examples=25)
def test_damaged_draft_model(world, damage):
    """The `draft` proposer's causal LM goes through the same checks as a target."""
    with Case(world) as case:
        folder = damage.apply(case, world.draft_lm)
        case.run(["run", "--model", world.model, "-p", "draft", "--draft", folder, "w5"])


@pytest.mark.parametrize("command", ["run", "export"])
@given(damage=DFLASH_DAMAGE)
@settings(FUZZ, max_examples=25)
def test_damaged_dflash_draft(world, command, damage):
    damaged_dflash_draft(world, command, damage)


def damaged_dflash_draft(world: World, command: str, damage: FolderDamage) -> None:
    with Case(world) as case:
        folder = damage.apply(case, world.dflash)
        if command == "run":
            case.run(["run", "--model", world.model, "-p", "dflash", "--draft", folder, "w5"])
        else:
            case.run(["export", "--draft", folder, "--format", "zlab", "--out", str(case.out)])


@pytest.mark.parametrize("command", ["run", "export"])
@pytest.mark.parametrize("where", [0.2, 0.7])
def test_dflash_config_not_an_object(world, command, where):
    damaged_dflash_draft(world, command, FolderDamage("json-not-object", where, b"x"))


@given(where=st.floats(0, 0.999), byte=st.sampled_from(NOT_UTF8))
@FEW
def test_dflash_config_not_utf8(world, where, byte):
    with Case(world) as case:
        folder = case.copy(world.dflash, "draft")
        raw = (folder / "config.json").read_bytes()
        at = int(len(raw) * where)
        (folder / "config.json").write_bytes(raw[:at] + byte + raw[at:])
        case.run(["run", "--model", world.model, "-p", "dflash", "--draft", str(folder), "w5"])


@pytest.mark.parametrize("command,option", [("check", "--prompts"), ("bench", "--dataset"),
                                            ("data generate", "--prompts")])
@given(damage=JSONL_DAMAGE, data=st.data())
@settings(FUZZ, max_examples=25)
def test_damaged_prompt_file(world, command, option, damage, data):
    assume(not (command == "data generate" and damage.how == "empty"))  # test_data_generate_empty_prompts_file
    with Case(world) as case:
        args = base_args(command, world, case) + data.draw(extras(command), label="extras")
        given = "-d" if option == "--dataset" else option
        if given in args:  # data generate's --prompts adds up: replace the good file
            args[args.index(given) + 1] = damage.apply(case)
        else:
            args += [option, damage.apply(case)]
        case.run(args)


@pytest.mark.parametrize("blank", ["", "\n", " \n\n"])
def test_data_generate_empty_prompts_file(world, blank):
    with Case(world) as case:
        (case.dir / "empty.jsonl").write_text(blank)
        args = base_args("data generate", world, case)
        args[args.index("--prompts") + 1] = str(case.dir / "empty.jsonl")
        case.run(args)


@given(how=st.sampled_from(["truncate", "not-utf8", "not-object", "missing"]), where=st.floats(0, 0.999))
@settings(FUZZ, max_examples=12)
def test_damaged_data_index(world, how, where):
    with Case(world) as case:
        folder = case.copy(world.data, "data")
        index = folder / "index.json"
        raw = index.read_bytes()
        if how == "truncate":
            index.write_bytes(raw[: int((len(raw) - 1) * where)])
        elif how == "not-utf8":
            at = int(len(raw) * where)
            index.write_bytes(raw[:at] + b"\xff\xfe" + raw[at:])
        elif how == "not-object":
            index.write_text("[]")
        else:
            index.unlink()
        args = base_args("train", world, case)
        args[args.index("--data") + 1] = str(folder)
        case.run(args)


# -- existing output folders ----------------------------------------------------------------------------------------

NAMES = st.text(st.characters(whitelist_categories=("L", "N")), min_size=1, max_size=10)


@pytest.mark.parametrize("command", ["bench", "data generate", "train", "export"])
@given(name=NAMES, content=st.binary(max_size=64), what=st.sampled_from(["foreign", "file"]))
@FUZZ
def test_existing_output_folder(world, command, name, content, what):
    """An --out folder holding a user's file, or an --out that is a file: refused, nothing touched."""
    with Case(world) as case:
        if what == "foreign":
            case.out.mkdir()
            (case.out / f"{name}.txt").write_bytes(content)
        else:
            case.out.write_bytes(content)
        args = base_args(command, world, case) + TAIL.get(command, [])
        # the fresh output folder is not fresh here: hash it too
        case.out, out = case.dir / "nothing-fresh", case.out
        case.run(args, (str(out),))


@given(content=st.binary(max_size=64), owner=st.sampled_from(["results", "other-command"]))
@FEW
def test_bench_out_with_another_run(world, content, owner):
    with Case(world) as case:
        out = case.dir / "previous"
        out.mkdir()
        if owner == "results":
            (out / ".specdec-owner").write_text("written by specdec bench\n")
            (out / "results.json").write_bytes(content)
            needle = "results.json"
        else:
            (out / ".specdec-owner").write_text("written by specdec data generate\n")
            needle = "specdec data generate"
        args = base_args("bench", world, case)
        args[args.index("--out") + 1] = str(out)
        case.run(args, (needle,))


@given(inside=st.sampled_from(["", "sub", "sub/deeper"]))
@FEW
def test_export_onto_its_own_draft(world, inside):
    with Case(world) as case:
        folder = case.copy(world.dflash, "draft")
        case.run(["export", "--draft", str(folder), "--format", "zlab", "--out", str(folder / inside)])
