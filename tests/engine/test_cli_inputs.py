"""The command line's own inputs: every bad value ends in one ``error: ...`` line on stderr and an
exit status (2: a usage error or an input the engine refuses; 1: a file or folder that does not
exist), never a traceback. Most cases are refused before any model loads; the model, where one
loads, is the fixtures' tiny-llama-hf (4 MB, with a real tokenizer)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from engine.cli import build_parser
from engine.cli import main as cli_main
from engine.errors import SamplingSettingError, UsageError

REPO = Path(__file__).parents[2]


@pytest.fixture(scope="module")
def model(exl3_dir: Path) -> Path:
    return exl3_dir / "tiny-llama-hf"


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("inputs")
    text = root / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 20, encoding="utf-8")
    latin1 = root / "latin1.txt"
    latin1.write_bytes("café crème, déjà vu".encode("latin-1"))
    return {"text": text, "latin1": latin1, "root": root}


def run_cli(capsys, argv: list[str]) -> tuple[int, str, str]:
    code = cli_main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(err: str, *fragments: str) -> None:
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


# (case id, argv after the model/file arguments, exit status, fragments the line must hold)
GENERATE_CASES = [
    ("n negative", ["-n", "-5"], 2, ["-n/--max-new-tokens", "must be at least 1, got -5"]),
    ("n zero", ["-n", "0"], 2, ["-n/--max-new-tokens", "must be at least 1, got 0"]),
    ("n not a number", ["-n", "lots"], 2, ["--max-new-tokens", "whole number", "'lots'"]),
    ("temperature nan", ["--temperature", "nan"], 2, ["--temperature must be a finite number >= 0", "nan"]),
    ("temperature inf", ["--temperature", "inf"], 2, ["--temperature", "got inf"]),
    ("temperature negative", ["--temperature", "-0.5"], 2, ["--temperature", ">= 0", "-0.5"]),
    ("top-p above 1", ["--top-p", "2"], 2, ["--top-p must be a number in (0, 1]", "got 2.0"]),
    ("top-p zero", ["--top-p", "0"], 2, ["--top-p", "(0, 1]"]),
    ("top-k negative", ["--top-k", "-3"], 2, ["--top-k must be a whole number >= 0", "got -3"]),
    ("min-p above 1", ["--min-p", "1.5"], 2, ["--min-p must be a number in [0, 1]"]),
    ("repetition penalty 0", ["--repetition-penalty", "0"], 2, ["--repetition-penalty", "> 0"]),
    ("presence penalty nan", ["--presence-penalty", "nan"], 2, ["--presence-penalty", "finite"]),
    ("frequency penalty inf", ["--frequency-penalty=-inf"], 2, ["--frequency-penalty", "finite"]),
    ("seed negative", ["--seed", "-1"], 2, ["--seed must be a whole number in [0, 2**64)"]),
    ("cache bits", ["--cache-bits", "9"], 2, ["--cache-bits", "2..8 or 16", "'9'"]),
    ("cache bits text", ["--cache-bits", "four"], 2, ["--cache-bits", "'four'"]),
    ("system without chat", ["--system", "be brief"], 2, ["--system needs --chat"]),
    (
        "image missing",
        ["--chat", "--image", "no-such-picture.png"],
        1,
        ["image no-such-picture.png does not exist"],
    ),
    ("unknown option", ["--temprature", "1"], 2, ["unrecognized arguments: --temprature"]),
]


def cases(table: list) -> list:
    """``table`` rows as pytest params named by their first column."""
    return [pytest.param(*row[1:], id=row[0]) for row in table]


@pytest.mark.parametrize("argv,status,fragments", cases(GENERATE_CASES))
def test_generate_refuses_bad_options(capsys, model: Path, argv, status, fragments) -> None:
    code, out, err = run_cli(capsys, ["generate", "-m", str(model), "-p", "hi", "--device", "cpu", *argv])
    assert code == status and out == ""
    assert_one_line_error(err, *fragments)


def test_generate_refuses_an_empty_prompt(capsys, model: Path) -> None:
    # tiny-llama-hf's tokenizer adds no BOS: "" is no token at all, nothing to continue.
    code, out, err = run_cli(capsys, ["generate", "-m", str(model), "-p", "", "--device", "cpu", "--json"])
    assert code == 2 and out == ""
    assert_one_line_error(err, "the prompt is empty", "--chat")


def test_a_missing_model_folder_is_named_as_such(capsys, tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    for argv in (
        ["generate", "-m", str(missing), "-p", "hi"],
        ["ppl", "-m", str(missing), "--text-file", str(tmp_path)],
        ["logits", "-m", str(missing), "--chat", "-p", "hi", "--out", str(tmp_path / "l.st")],
    ):
        code, _, err = run_cli(capsys, argv)
        assert code == 1, argv
        assert_one_line_error(err, f"model directory {missing} does not exist")
        assert "tokenizer.json" not in err


PPL_CASES = [
    ("missing text file", ["--text-file", "{root}/nope.txt"], 1, ["text file", "nope.txt does not exist"]),
    ("non-UTF-8 text", ["--text-file", "{latin1}"], 2, ["latin1.txt is not UTF-8 text", "byte 0xe9"]),
    ("text file is a folder", ["--text-file", "{root}"], 2, ["is a folder, not a file"]),
    ("ctx zero", ["--text-file", "{text}", "--ctx", "0"], 2, ["argument --ctx: must be at least 2, got 0"]),
    ("ctx one", ["--text-file", "{text}", "--ctx", "1"], 2, ["--ctx: must be at least 2"]),
    ("ctx negative", ["--text-file", "{text}", "--ctx", "-8"], 2, ["--ctx: must be at least 2"]),
    (
        "ctx past the model's context",
        ["--text-file", "{text}", "--ctx", "5000"],
        2,
        ["--ctx 5000 is longer than the context of", "(4096 tokens)"],
    ),
    (
        "max windows zero",
        ["--text-file", "{text}", "--max-windows", "0"],
        2,
        ["--max-windows: must be at least 1"],
    ),
]


@pytest.mark.parametrize("argv,status,fragments", cases(PPL_CASES))
def test_ppl_refuses_bad_inputs(capsys, model: Path, files, argv, status, fragments) -> None:
    argv = [a.format(**files) for a in argv]
    code, out, err = run_cli(capsys, ["ppl", "-m", str(model), "--device", "cpu", *argv])
    assert code == status and out == ""
    assert_one_line_error(err, *fragments)


def test_ppl_reference_past_its_context_is_refused(capsys, model: Path, files, tmp_path: Path) -> None:
    short = tmp_path / "short"
    shutil.copytree(model, short)
    config = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 64}))
    argv = ["ppl", "-m", str(model), "--reference", str(short), "--text-file", str(files["text"])]
    code, _, err = run_cli(capsys, [*argv, "--ctx", "128", "--device", "cpu"])
    assert code == 2
    assert_one_line_error(err, "--ctx 128 is longer than the context of", "(64 tokens)")


OTHER_CASES = [
    (
        "logits ids",
        ["logits", "-m", "{model}", "--ids", "1,x", "--out", "{root}/l.st"],
        2,
        ["--ids", "'1,x'"],
    ),
    (
        "logits out folder",
        ["logits", "-m", "{model}", "--ids", "1,2", "--out", "{root}/none/l.st"],
        1,
        ["the folder of --out", "does not exist"],
    ),
    (
        "logits image missing",
        [
            "logits",
            "-m",
            "{model}",
            "--chat",
            "-p",
            "hi",
            "--image",
            "{root}/none.png",
            "--out",
            "{root}/l.st",
        ],
        1,
        ["image", "none.png does not exist"],
    ),
    (
        "convert bits nan",
        ["convert", "-i", "{model}", "-o", "{root}/c", "-b", "nan"],
        2,
        ["-b/--bits", "[1, 8]"],
    ),
    ("convert bits 9", ["convert", "-i", "{model}", "-o", "{root}/c", "-b", "9"], 2, ["-b/--bits", "'9'"]),
    (
        "convert head bits",
        ["convert", "-i", "{model}", "-o", "{root}/c", "-b", "4", "--head-bits", "9"],
        2,
        ["--head-bits: invalid choice: 9"],
    ),
    (
        "convert cal rows",
        ["convert", "-i", "{model}", "-o", "{root}/c", "-b", "4", "--cal-rows", "0"],
        2,
        ["--cal-rows: must be at least 1"],
    ),
    (
        "convert tune lr",
        ["convert", "-i", "{model}", "-o", "{root}/c", "-b", "4", "--tune-lr", "nan"],
        2,
        ["--tune-lr: must be a finite number > 0"],
    ),
    ("import missing gguf", ["import-gguf", "{root}/none.gguf", "{root}/g"], 1, ["none.gguf: no such file"]),
    ("search limit", ["search", "llama", "--limit", "0"], 2, ["--limit: must be at least 1"]),
    ("download retries", ["download", "org/model", "--retries", "-2"], 2, ["--retries: must be at least 1"]),
    ("cache capacity budget", ["cache-capacity", "-m", "{model}", "--budget-gb", "nan"], 2, ["--budget-gb"]),
    (
        "constrain-eval seeds",
        ["constrain-eval", "-m", "{model}", "--seeds", "0"],
        2,
        ["--seeds: must be at least 1"],
    ),
    ("no subcommand", [], 2, ["the following arguments are required: command"]),
    ("unknown subcommand", ["genrate"], 2, ["invalid choice: 'genrate'"]),
]


@pytest.mark.parametrize("argv,status,fragments", cases(OTHER_CASES))
def test_other_commands_refuse_bad_inputs(capsys, model: Path, files, argv, status, fragments) -> None:
    argv = [a.format(model=model, **files) for a in argv]
    code, out, err = run_cli(capsys, argv)
    assert code == status
    assert_one_line_error(err, *fragments)


def test_traceback_flag_shows_the_error_itself(model: Path) -> None:
    # Before or after the subcommand: the error propagates instead of becoming a line.
    base = ["generate", "-m", str(model), "-p", "hi", "--top-p", "2"]
    with pytest.raises(UsageError, match="--top-p"):
        cli_main(["--traceback", *base])
    with pytest.raises(UsageError, match="--top-p"):
        cli_main([*base, "--traceback"])


def test_a_reply_cut_by_the_context_says_so(capsys, model: Path, tmp_path: Path) -> None:
    # A model whose context is 16 tokens: a 13-token prompt leaves room for 3, whatever -n says.
    short = tmp_path / "short"
    shutil.copytree(model, short)
    config = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 16}))
    argv = ["generate", "-m", str(short), "-p", "one_two_three_four_five", "--device", "cpu", "--json"]
    code, out, err = run_cli(capsys, [*argv, "-n", "50"])
    assert code == 0, err
    reply = json.loads(out)
    assert reply["prompt_tokens"] + reply["new_tokens"] == 16
    assert reply["stop_reason"] == "context_length"
    # The budget running out first is still labelled as such.
    code, out, _ = run_cli(capsys, [*argv, "-n", "2"])
    assert code == 0 and json.loads(out)["stop_reason"] == "max_new_tokens"
    # And the text summary (without --json) shows the same reason.
    code, _, err = run_cli(capsys, argv[:-1] + ["-n", "50"])
    assert code == 0 and "stop: context_length]" in err


def test_no_traceback_reaches_a_real_process(model: Path, files) -> None:
    """``python -m engine`` as a user runs it: the exit status and a single line on stderr, for an
    argparse complaint and for an engine error (each process imports torch: ~5 s)."""
    cases = [
        (
            ["generate", "-m", str(model), "-p", "hi", "-n", "-5"],
            2,
            "-n/--max-new-tokens: must be at least 1",
        ),
        (["ppl", "-m", str(model), "--text-file", str(files["latin1"])], 2, "is not UTF-8 text"),
    ]
    for argv, status, fragment in cases:
        done = subprocess.run(
            [sys.executable, "-m", "engine", *argv], capture_output=True, text=True, cwd=REPO, timeout=300
        )
        assert done.returncode == status, done.stderr
        assert_one_line_error(done.stderr, fragment)
        assert done.stdout == ""


def test_sampling_errors_map_to_their_option(model: Path) -> None:
    # The CLI's message names the option; the engine's own error (what the app shows) names the field.
    from engine.commands.generate import sampling_from_args
    from engine.generation.sampling import SamplingSettings

    with pytest.raises(SamplingSettingError, match=r"^repetition_penalty must be a finite number > 0"):
        SamplingSettings(repetition_penalty=-1.0).validate()
    argv = ["generate", "-m", str(model), "-p", "hi", "--repetition-penalty", "-1"]
    args = build_parser().parse_args(argv)
    expected = r"^--repetition-penalty must be a finite number > 0 \(1 = off\), got -1.0$"
    with pytest.raises(UsageError, match=expected):
        sampling_from_args(args)
