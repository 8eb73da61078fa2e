"""`pagedmoe eval` on a tiny checkpoint: perplexity equals the one transformers gives on the same windows."""
import json
import math

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
    out = tmp_path / "r.json"
    assert main(["eval", str(ckpt), "--dataset", str(data), "--max-tokens", "50", "--output-json", str(out),
                 "--device", "cpu"]) == 0
    assert json.loads(out.read_text())["tokens"] == 50
    assert main(["eval", str(ckpt), "--dataset", str(tmp_path / "missing.jsonl"), "--device", "cpu"]) == 2
