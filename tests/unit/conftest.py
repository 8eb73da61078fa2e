import json

import pytest


@pytest.fixture
def plan_report(tmp_path, capsys):
    """run(MODEL, *flags) -> (printed text, JSON report) of `pagedmoe plan ... --json`; its exit status is 0."""
    def run(*args):
        from pagedmoe.cli import main

        out_json = tmp_path / "plan.json"
        rc = main(["plan", *map(str, args), "--json", str(out_json)])
        text = capsys.readouterr().out
        assert rc == 0, text
        return text, json.loads(out_json.read_text())
    return run
