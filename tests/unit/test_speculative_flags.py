"""vLLM's --speculative-config and SGLang's --speculative-algorithm family start the same speculation as
our flags, and what crane-mp does not serve is refused at parse time, naming it."""

from __future__ import annotations

import pytest

from crane_mp.cli import parse_args
from crane_mp.testing.make_model import make_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(make_model("qwen3", "tiny", tmp_path_factory.mktemp("m") / "qwen3"))


def speculation(model_dir: str, *flags: str) -> tuple:
    engine = parse_args(["--model-path", model_dir, *flags], {}).engine
    return (engine.speculative_method, engine.speculative_num_tokens, engine.speculative_model,
            engine.speculative_ngram_min, engine.speculative_ngram_max, engine.speculative_disable_batch_size)


@pytest.mark.parametrize("flags, expected", [
    (["--speculative-config", '{"method": "deepseek_mtp", "num_speculative_tokens": 2}'], ("mtp", 2, None, 2, 4, 8)),
    (["--speculative-config", '{"method": "mtp", "num_speculative_tokens": 1, "disable_by_batch_size": 4}'],
     ("mtp", 1, None, 2, 4, 4)),
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 3, '
                              '"prompt_lookup_max": 6}'], ("ngram", 5, None, 3, 6, 8)),
    (["--speculative-config", '{"model": "DRAFT", "num_speculative_tokens": 3}'], ("draft", 3, "DRAFT", 2, 4, 8)),
    (["--speculative-algorithm", "NEXTN", "--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
      "--speculative-num-draft-tokens", "4"], ("mtp", 3, None, 2, 4, 8)),
    (["--speculative-algorithm", "eagle", "--speculative-num-draft-tokens", "3"], ("mtp", 2, None, 2, 4, 8)),
    (["--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", "DRAFT"],
     ("draft", 4, "DRAFT", 2, 4, 8)),
    (["--speculative-algorithm", "NGRAM"], ("ngram", 4, None, 2, 4, 8)),
    (["--speculative-draft-model-path", "DRAFT"], ("draft", 4, "DRAFT", 2, 4, 8)),
])
def test_a_peer_s_speculation_flags_start_the_same_speculation(model_dir, flags, expected):
    expected = tuple(model_dir if value == "DRAFT" else value for value in expected)
    flags = [model_dir if flag == "DRAFT" else flag.replace("DRAFT", model_dir) for flag in flags]
    assert speculation(model_dir, *flags) == expected


@pytest.mark.parametrize("flags, message", [
    (["--speculative-config", '{"method": "eagle3", "model": "x"}'], "method 'eagle3' is not served"),
    (["--speculative-config", '{"method": "mtp", "draft_tensor_parallel_size": 2}'],
     "draft_tensor_parallel_size not served"),
    (["--speculative-config", "{method: mtp}"], "is not JSON"),
    (["--speculative-config", '{"method": "mtp", "num_speculative_tokens": "3"}'], "must be a whole number"),
    (["--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", "x"], "EAGLE heads are not served"),
    (["--speculative-algorithm", "NEXTN", "--speculative-eagle-topk", "4"], "--speculative-eagle-topk"),
    (["--speculative-algorithm", "NEXTN", "--speculative-num-steps", "3", "--speculative-num-draft-tokens", "8"],
     "--speculative-num-steps + 1"),
    (["--speculative-method", "ngram", "--speculative-algorithm", "NEXTN"], "disagree"),
])
def test_what_crane_mp_does_not_serve_is_refused_naming_it(model_dir, flags, message, capsys):
    with pytest.raises(SystemExit):
        parse_args(["--model-path", model_dir, *flags], {})
    assert message in capsys.readouterr().err
