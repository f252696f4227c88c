"""What a person at the command line meets: help on every option, a quiet stop on a closed pipe,
a visible warning on a weak audit, and a report with its plots."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest

from witness.bundle.reader import open_bundle
from witness.cli import build_parser, main
from witness.evals.evaluate import evaluate
from witness.report import write_report
from witness.verify import Policy, Verifier
from witness.verify.challenges import weak_bound_warning


def _parsers(parser: argparse.ArgumentParser, path: str = "witness"):
    """Every parser of the command, with its command path."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, f"{path} {name}")


def test_every_option_of_every_command_has_a_help_line():
    missing = []
    commands = 0
    for path, parser in _parsers(build_parser()):
        commands += 1
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            if action.help is argparse.SUPPRESS:
                continue
            if not (action.help or "").strip():
                missing.append(f"{path} {'/'.join(action.option_strings) or action.dest}")
    assert commands > 15  # the walk reached the nested groups (data, leaderboard)
    assert not missing, "options without a help line:\n" + "\n".join(missing)


@pytest.mark.parametrize("command, expected", [
    (["keygen"], ["--out", "where to write the private key", "--force"]),
    (["train"], ["--task", "lists the tasks", "--steps", "--checkpoint-every", "--threads"]),
    (["demo"], ["--out", "--steps", "--challenges"]),
    (["serve"], ["--host", "this machine only", "--port"]),
    (["eval"], ["--out", "the certificate file"]),
    (["leaderboard", "demo"], ["--dir", "--port"]),
    (["inspect"], ["--json", "one JSON object"]),
])
def test_the_help_pages_name_what_each_option_does(command, expected, capsys):
    with pytest.raises(SystemExit) as e:
        main([*command, "--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for word in expected:
        assert word in text, (command, word)


def _with_closed_stdout(args: list[str], cwd) -> subprocess.CompletedProcess:
    """Run the command with its stdout a pipe whose reader is already gone (``| head`` that quit)."""
    r, w = os.pipe()
    os.close(r)
    try:
        return subprocess.run([sys.executable, "-m", "witness.cli", *args], stdout=w, stderr=subprocess.PIPE,
                              text=True, timeout=300, cwd=cwd)
    finally:
        os.close(w)


@pytest.mark.parametrize("args", [["inspect", "B", "--json"], ["--help"], ["verify", "--allow-weak", "B", "--challenges", "2", "--json"]])
def test_a_closed_pipe_ends_quietly(args, honest_bundle, tmp_path):
    done = _with_closed_stdout([str(honest_bundle) if a == "B" else a for a in args], tmp_path)
    assert "Traceback" not in done.stderr and "Broken pipe" not in done.stderr, done.stderr
    # 141 = 128 + SIGPIPE, as a shell reports for cat; argparse's own help printer ignores the closed pipe
    assert done.returncode == (0 if args == ["--help"] else 141), (done.returncode, done.stderr)


def test_a_pipe_that_reads_part_of_the_output_ends_quietly(honest_bundle, tmp_path):
    # the case as a person meets it: witness inspect DIR --json | head -n 2
    cmd = f"{sys.executable} -m witness.cli inspect {honest_bundle} --json | head -n 2"
    done = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)
    assert done.stdout.splitlines()[0] == "{" and len(done.stdout.splitlines()) == 2
    assert "Traceback" not in done.stderr, done.stderr


def test_a_weak_audit_is_flagged(honest_bundle, capsys):
    assert main(["verify", "--allow-weak", str(honest_bundle), "--challenges", "3", "--nonce", "01"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("ACCEPTED")
    assert "WARNING: weak audit" in out.splitlines()[1] and "14.26%" in out and "--challenges 45" in out, out
    assert main(["verify", "--allow-weak", str(honest_bundle), "--challenges", "3", "--nonce", "01", "--json"]) == 0
    assert "weak audit" in json.loads(capsys.readouterr().out)["warning"]


def test_a_strong_audit_is_not_flagged_and_the_confidence_asked_for_is_the_floor(honest_bundle):
    strong = Verifier(policy=Policy(challenges=45, nonce=b"\x01")).verify(honest_bundle)  # 45 >= the run's 40 steps: bound 1
    assert strong.detection_probability == 1 and strong.warning is None and "WARNING" not in strong.summary()
    assert weak_bound_warning(1 - 0.95**45, 0.05) is None  # 90.06 % clears the default floor of 90 %
    assert "below the 90%" in weak_bound_warning(1 - 0.95**44, 0.05)
    # asked for 99 %: 90 % is weak, and the warning says how many challenges reach what was asked
    asked = weak_bound_warning(1 - 0.95**45, 0.05, wanted=0.99)
    assert "below the 99% asked for" in asked and "--challenges 90 " in asked


def test_the_report_holds_its_plots(honest_bundle, tmp_path):
    from witness.commit.signing import generate_key
    from witness.evals.evaluate import verify_eval

    cert = evaluate(honest_bundle, generate_key())
    ev = verify_eval(cert, honest_bundle, spots=10, nonce=b"\x02")
    v = Verifier(policy=Policy(challenges=45, nonce=b"\x01")).verify(honest_bundle)
    out = write_report(open_bundle(honest_bundle), tmp_path / "report", v.summary(),
                       [(r.step, r.passed) for r in v.results], ev.aggregates)
    for name in ("loss.png", "optimizer.png", "fingerprints.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    md = (out / "report.md").read_text()
    assert "![learning rate and gradient norm](optimizer.png)" in md and "behavioral fingerprint" in md
    assert f"evaluation: accuracy: {ev.aggregates['accuracy']:.6g}" in md
    html = (out / "report.html").read_text()
    assert html.count("<svg") == 3 and "<img" not in html  # inline: one file holds everything
    for label in ("learning rate", "gradient norm", "loss on the probe", "projected output", "replayed: matched",
                  "certified evaluation loss", "ACCEPTED"):
        assert label in html, label
    assert "<figcaption>The behavioral fingerprint: after every step" in html


def test_the_report_command_checks_the_certificate_it_plots(honest_bundle, tmp_path, capsys):
    from witness.commit.hashing import canonical_json
    from witness.commit.signing import generate_key

    cert = evaluate(honest_bundle, generate_key())
    (tmp_path / "cert.json").write_bytes(canonical_json(cert))
    assert main(["report", str(honest_bundle), "--out", str(tmp_path / "r"), "--eval", str(tmp_path / "cert.json"),
                 "--spot", "5"]) == 0
    assert "certified evaluation loss" in (tmp_path / "r" / "report.html").read_text()
    # and the run's own verdict, from the audit verify runs by default (issue 52, loops item 5)
    md = (tmp_path / "r" / "report.md").read_text()
    assert "## Verdict" in md and "ACCEPTED" in md, md[:400]
    assert main(["report", str(honest_bundle), "--out", str(tmp_path / "r3"), "--no-verify"]) == 0
    assert "## Verdict" not in (tmp_path / "r3" / "report.md").read_text()
    cert["aggregates"]["accuracy"] = 1.0  # a better score than the model earned
    (tmp_path / "cert.json").write_bytes(canonical_json(cert))
    assert main(["report", str(honest_bundle), "--out", str(tmp_path / "r2"), "--eval", str(tmp_path / "cert.json")]) == 1
    assert not (tmp_path / "r2").exists()
