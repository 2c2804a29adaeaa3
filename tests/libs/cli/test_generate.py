import pytest

from libs.cli.main import main
from libs.engine import Engine, SamplingParams
from libs.engine.tiny import write_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny"), seed=1)


def test_generate_streams_the_engines_greedy_text(tiny, capsys):
    assert (
        main(
            [
                "generate",
                "--model",
                str(tiny),
                "--prompt",
                "Hello there",
                "--max-tokens",
                "12",
                "--ignore-eos",
            ]
        )
        == 0
    )
    out, err = capsys.readouterr()
    engine = Engine.from_pretrained(tiny)
    ids = engine.tokenizer.encode("Hello there")
    (ref,) = engine.generate([ids], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert out == ref.text + "\n"
    assert "12 generated, finish_reason=length" in err


def test_generate_chat_and_bad_input(tiny, capsys):
    assert main(["generate", "--model", str(tiny), "--prompt", "hi", "--chat", "--max-tokens", "3", "--seed", "1",
                 "--temperature", "0.7"]) == 0  # fmt: skip
    assert "prompt tokens" in capsys.readouterr().err
    assert main(["generate", "--model", str(tiny), "--prompt", "hi", "--top-p", "0"]) == 2
    assert "top_p" in capsys.readouterr().err
