"""Tiny random BERT-family checkpoints as sentence-transformers saves them (tests, examples): a
CrossEncoder (`--task score`) or a SentenceTransformer embedding model (`--task embed`), BERT with a
WordPiece vocabulary or RoBERTa / XLM-RoBERTa with a byte-level BPE one, weights drawn wide enough (initializer
range 0.3) that scores and vectors differ from pair to pair.

    python -m crane_mp.testing.make_encoder --arch bert --task score --out DIR
"""

from __future__ import annotations

import argparse
import string
import tempfile
from pathlib import Path

ARCHS = ("bert", "roberta", "xlm-roberta")
_WORDS = ("the of and to in is was are what who which where paris france capital city yellow banana bananas "
          "fruit tower eiffel weather rain sun river spring").split()
_POSITIONS = 128  # RoBERTa's table holds two more: its positions start at padding_idx + 1
_SHAPE = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128,
          "initializer_range": 0.3}


def _tokenizer(arch: str, out: Path):
    from transformers import BertTokenizerFast, PreTrainedTokenizerFast

    if arch == "bert":
        vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *string.ascii_lowercase, *string.digits,
                 *string.punctuation, *("##" + c for c in string.ascii_lowercase), *_WORDS]
        (out / "vocab.txt").write_text("\n".join(vocab) + "\n")
        return BertTokenizerFast(vocab_file=str(out / "vocab.txt"))
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    specials = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    corpus = [" ".join(_WORDS), string.ascii_letters + string.digits + string.punctuation]
    bpe.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bpe.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0))
    return PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", sep_token="</s>",
                                   cls_token="<s>", unk_token="<unk>", pad_token="<pad>", mask_token="<mask>")


def make_encoder(arch: str, out: str | Path, task: str = "score", pooling: str = "mean", seed: int = 0) -> Path:
    """Write the checkpoint to `out`: task "score" (a one-label CrossEncoder) or "embed" (a
    SentenceTransformer with `pooling`, "mean" or "cls", then Normalize)."""
    import torch
    from transformers import AutoConfig, AutoModel, AutoModelForSequenceClassification

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _tokenizer(arch, out)
    tokenizer.model_max_length = _POSITIONS  # as real checkpoints say: longer inputs are cut
    extra = {"pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2, "type_vocab_size": 1,
             "max_position_embeddings": _POSITIONS + 2} if arch != "bert" else {"max_position_embeddings": _POSITIONS}
    config = AutoConfig.for_model(arch, vocab_size=len(tokenizer), **_SHAPE, **extra)
    torch.manual_seed(seed)
    if task == "score":
        from sentence_transformers import CrossEncoder

        config.num_labels = 1
        AutoModelForSequenceClassification.from_config(config).eval().save_pretrained(out)
        tokenizer.save_pretrained(out)
        CrossEncoder(str(out), device="cpu").save(str(out))
        return out
    from sentence_transformers import SentenceTransformer, models

    with tempfile.TemporaryDirectory() as base:
        AutoModel.from_config(config).eval().save_pretrained(base)
        tokenizer.save_pretrained(base)
        transformer = models.Transformer(base)
        dimension = getattr(transformer, "get_embedding_dimension", None) or transformer.get_word_embedding_dimension
        pooled = models.Pooling(dimension(), pooling)
        SentenceTransformer(modules=[transformer, pooled, models.Normalize()], device="cpu").save(str(out))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", choices=ARCHS, required=True)
    parser.add_argument("--task", choices=("score", "embed"), default="score")
    parser.add_argument("--pooling", choices=("mean", "cls"), default="mean")
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(make_encoder(args.arch, args.out, args.task, args.pooling, args.seed))


if __name__ == "__main__":
    main()
