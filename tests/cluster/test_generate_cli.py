"""``tandem generate`` end to end, as a user runs it (a real subprocess, the default model)."""

from __future__ import annotations

import json
import subprocess
import sys

from workers.protocol.sampling_params import SamplingParams


def run_cli(*args, stdin=None):
    return subprocess.run([sys.executable, "-m", "cluster.cli", "generate", *args], input=stdin,
                          capture_output=True, text=True, timeout=300)


def test_generate_jsonl_in_order(tmp_path, make_engine):
    chat = {"messages": [{"role": "user", "content": "What is the capital of France?"}]}
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps(chat) + "\n" + json.dumps({"prompt": "1, 2, 3, 4,"}) + "\n")
    proc = run_cli("--input", str(inp), "--max-tokens", "12")
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(x) for x in proc.stdout.splitlines()]
    assert len(lines) == 2
    # The default model as this process runs it (the Q4_1 path on CPU: "L'Étoile, la Marseillaise, ...", as
    # llama.cpp answers too; the dense path and HF say "The capital of France is Paris.", a 0.08-logit tie).
    want = make_engine().generate([chat], SamplingParams(max_tokens=12, temperature=0.0))[0]
    assert lines[0]["text"] == want.text and lines[0]["finish_reason"] == want.finish_reason
    assert lines[1]["finish_reason"] == "length" and len(lines[1]["token_ids"]) == 12
    assert set(lines[1]) == {"text", "token_ids", "prompt_token_ids", "finish_reason"}


def test_generate_reports_bad_input_clearly(tmp_path):
    inp = tmp_path / "bad.jsonl"
    inp.write_text('{"oops": 1}\n')
    proc = run_cli("--input", str(inp))
    assert proc.returncode != 0 and "expected" in proc.stderr
    proc = run_cli("--prompt", "hi", "--max-tokens", "0")
    assert proc.returncode == 2 and "max_tokens must be at least 1" in proc.stderr
