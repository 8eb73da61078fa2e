"""`pagedmoe eval` on a tiny checkpoint: perplexity equals the one transformers gives on the same windows."""
import json
import math

import pytest
import torch

from tiny_models import make_tiny_checkpoint


def test_eval_perplexity_matches_transformers(tmp_path):
    from pagedmoe.cli import main

    ckpt = tmp_path / "m"
    hf = make_tiny_checkpoint("qwen3_moe", ckpt, seed=8)
    data = tmp_path / "held.jsonl"
    docs = ["def f(x):\n    return x * 2\n" * 6, "class A:\n    pass\n" * 5]
    data.write_text("\n".join(json.dumps({"text": d}) for d in docs))
    out = tmp_path / "r.json"
    plot = tmp_path / "usage.png"
    rc = main(["eval", str(ckpt), "--dataset", str(data), "--context", "32", "--output-json", str(out),
               "--plot", str(plot), "--device", "cpu"])
    assert rc == 0
    r = json.loads(out.read_text())
    # Reference: the same windows through transformers.
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(ckpt))
    nll, n, routed = 0.0, 0, 0
    with torch.no_grad():
        for d in docs:
            ids = tok.encode(d)
            for i in range(0, len(ids), 32):
                w = ids[i:i + 32]
                if len(w) < 2:
                    continue
                logp = torch.log_softmax(hf(torch.tensor([w])).logits[0, :-1].double(), -1)
                nll -= logp.gather(1, torch.tensor(w[1:])[:, None]).sum().item()
                n += len(w) - 1
                routed += len(w) * hf.config.num_experts_per_tok  # every position is routed
    assert r["tokens"] == n
    assert math.isclose(r["perplexity"], math.exp(nll / n), rel_tol=1e-4)
    assert 0.0 <= r["top1_accuracy"] <= 1.0
    assert plot.stat().st_size > 1000
    assert len(r["expert_usage"]) == 2 and all(sum(row) == routed for row in r["expert_usage"])


def test_eval_max_tokens_and_bad_dataset(tmp_path):
    from pagedmoe.cli import main

    ckpt = tmp_path / "m"
    make_tiny_checkpoint("mixtral", ckpt, seed=2)
    data = tmp_path / "d.txt"
    data.write_text("for i in range(10):\n    print(i)\n" * 20)
    out = tmp_path / "new" / "r.json"  # its folder is made, as bench and plan make theirs
    assert main(["eval", str(ckpt), "--dataset", str(data), "--max-tokens", "50", "--output-json", str(out),
                 "--device", "cpu"]) == 0
    assert json.loads(out.read_text())["tokens"] == 50
    assert main(["eval", str(ckpt), "--dataset", str(tmp_path / "missing.jsonl"), "--device", "cpu"]) == 2


def test_eval_documents_longer_than_the_tokenizers_max_length_raise_no_warning(tmp_path, capfd):
    """Documents are cut into windows after tokenizing, so transformers' "Token indices sequence length is longer than
    the specified maximum sequence length for this model ... will result in indexing errors" (every `pagedmoe eval`
    of the default model: its held-out file is longer than its tokenizer's 2048) is wrong there."""
    from pagedmoe.cli import main

    ckpt = tmp_path / "m"
    make_tiny_checkpoint("qwen3_moe", ckpt, seed=2)
    cfg = json.loads((ckpt / "tokenizer_config.json").read_text())
    (ckpt / "tokenizer_config.json").write_text(json.dumps({**cfg, "model_max_length": 64}))
    data = tmp_path / "d.txt"
    data.write_text("for i in range(10):\n    print(i)\n" * 20)
    assert main(["eval", str(ckpt), "--dataset", str(data), "--context", "32", "--output-json",
                 str(tmp_path / "r.json"), "--device", "cpu"]) == 0
    assert json.loads((tmp_path / "r.json").read_text())["tokens"] > 64
    assert "indexing errors" not in capfd.readouterr().err


@pytest.mark.parametrize("args, content, expected", [
    (["--dataset", "{d}"], b'{"text": "ok"}\n{"text": 5}\n', "d.jsonl:2: 'text' must be a string, got int"),
    (["--dataset", "{d}"], b'\n{"txt": "ok"}\n', "d.jsonl:2: expected a JSON object with a 'text' field ('text')"),
    (["--dataset", "{d}"], b"abc\xff\n", "d.jsonl is not UTF-8 text (byte 3"),
    (["--max-tokens", "0"], None, "--max-tokens must be >= 1, got 0"),
])
def test_eval_bad_input_fails_before_the_model_loads(tmp_path, capsys, monkeypatch, args, content, expected):
    from pagedmoe.cli import main
    from pagedmoe.engine import llm_engine

    def no_load(*_a, **_k):
        raise AssertionError("the model was loaded before the input was checked")

    monkeypatch.setattr(llm_engine, "LLMEngine", no_load)
    data = tmp_path / "d.jsonl"
    if content is not None:
        data.write_bytes(content)
    args = [a.format(d=data) for a in args]
    assert main(["eval", "--device", "cpu", "--output-json", str(tmp_path / "r.json"), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("pagedmoe eval: error: ") and "\n" not in err and expected in err, err


def test_context_longer_than_max_model_len_is_refused_and_the_default_fits(tmp_path, capsys):
    # an explicit --context the engine cannot score whole is an error, not silently shortened; the default
    # window fits a shorter model, and the JSON says which window was used
    from pagedmoe.cli import main

    ckpt = tmp_path / "ckpt"
    make_tiny_checkpoint("qwen3_moe", ckpt)
    data = tmp_path / "d.txt"
    data.write_text("def f(x):\n    return x * 2\n" * 40)
    base = ["eval", str(ckpt), "--dataset", str(data), "--device", "cpu", "--max-model-len", "64",
            "--max-tokens", "100"]
    assert main(base + ["--context", "128", "--output-json", str(tmp_path / "a.json")]) == 2
    assert "--context 128 exceeds max_model_len 64" in capsys.readouterr().err
    assert main(base + ["--output-json", str(tmp_path / "b.json")]) == 0
    assert json.loads((tmp_path / "b.json").read_text())["context"] == 64


def test_tensor_parallel_is_refused_before_the_ranks_start(capsys, monkeypatch):
    # scoring runs on one process: refused up front, not after both ranks loaded the model
    from pagedmoe.cli import main
    from pagedmoe.parallel import launch

    monkeypatch.setattr(launch, "setup_parallel", lambda config: pytest.fail("ranks were started"))
    assert main(["eval", "--device", "cpu", "--tensor-parallel-size", "2"]) == 2
    assert "does not support --tensor-parallel-size > 1" in capsys.readouterr().err
