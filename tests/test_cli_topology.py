"""ulysses-mcore topology: the groups of a layout, node crossings, heads and tokens, bad input."""


def test_topology_json_and_warnings(capsys):
    import json

    from ulysses_mcore.cli import topology as tool

    assert (
        tool.main(
            [
                "--world-size",
                "64",
                "--gpus-per-node",
                "8",
                "--tp",
                "2",
                "--ulysses",
                "4",
                "--pp",
                "2",
                "--num-attention-heads",
                "32",
                "--num-query-groups",
                "8",
                "--seq-length",
                "131072",
                "--rank",
                "5",
                "--json",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert out["groups_of_rank"]["ulysses"] == [1, 3, 5, 7]
    assert out["heads"]["query_heads_in_attention"] == 4 and out["tokens"]["per_rank_outside_attention"] == 32768
    assert out["warnings"] == []
    assert tool.main(["--world-size", "32", "--gpus-per-node", "4", "--tp", "2", "--ulysses", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert any("ulysses group(s) cross a node boundary" in w for w in out["warnings"])
    assert tool.main(["--world-size", "12", "--tp", "2", "--ulysses", "4", "--pp", "2"]) == 2
    assert "WORLD_SIZE(12)" in capsys.readouterr().err
