"""Every subcommand's --help renders (argparse formats help strings with %, so a stray '%' in a flag's help
breaks it) and names the flags users look for."""
import pytest

from pagedmoe.cli import main

COMMANDS = [["generate"], ["serve"], ["plan"], ["compress"], ["decompress"], ["eval"], ["bench", "throughput"],
            ["bench", "latency"], ["bench", "serve"], ["bench", "sweep"]]


@pytest.mark.parametrize("cmd", COMMANDS, ids=" ".join)
def test_help_renders(cmd, capsys):
    with pytest.raises(SystemExit) as exc:
        main([*cmd, "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: ")
    if cmd[0] in ("generate", "serve") or cmd == ["bench", "throughput"]:
        assert "--gpu-memory-gb" in out and "--host-memory-gb" in out
    if cmd == ["generate"]:  # llama.cpp's constraint flags
        assert all(f in out for f in ("--json-schema", "--json-schema-file", "--grammar", "--grammar-file"))
