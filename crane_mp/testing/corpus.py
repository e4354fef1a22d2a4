"""Deterministic multilingual text used to train the tiny test tokenizers."""

from __future__ import annotations

import random

_WORDS = """
the of and to in is that it for was on are with as be at by this have from or one had not but
what all were when we there can an your which their said if do will each about how up out them
then she many some so these would other into has more her two like him see time could no make
than first been its who now people my made over did down only way find use may water long little
very after words called just where most know get through back much before go good new write our
used me man too any day same right look think also around another came come work three word must
because does part even place well such here take why things help put years different away again
off went old number great tell men say small every found still between name should home big give
air line set own under read last never us left end along while might next sound below saw something
thought both few those always looked show large often together asked house don world going want
school important until form food keep children feet land side without boy once animals life enough
took sometimes four head above kind began almost live page got earth need far hand high year mother
light parts country father let night following picture being study second eyes soon times story boys
since white days ever paper hard near sentence better best across during today others however sure
means knew its try told young miles sun ways thing whole hear example heard several change answer
room sea against top turned learn point city play toward five using himself usually money seen
model server token request stream batch cache layer tensor kernel memory latency throughput prompt
""".split()

_FOREIGN_WORDS = """
café naïve señor über Zürich façade résumé crème brûlée São Paulo Ångström smörgåsbord jalapeño
déjà vu piñata Łódź Dvořák garçon Ærø Straße Öl Müller élève forêt hôtel niño coração Kraków
你好 世界 中文 模型 推理 服务器 日本語 東京 数据 请求
こんにちは ありがとう 한국어 안녕하세요
😀 🚀 🎉 👍 👍🏽 ❤️ 🔥 🤖 👨‍👩‍👧 🇫🇷 ✨ 🙂
""".split()

_SENTENCES = (
    "The quick brown fox jumps over the lazy dog.",
    "Hello, world! How are you today?",
    "Crème brûlée is a French dessert served at the café in Zürich.",
    "El niño comió una piñata con jalapeño, señor.",
    "Die Straße in München ist über zwei Kilometer lang.",
    "我们正在测试一个大语言模型推理服务器。",
    "日本語のテキストも少し含まれています。",
    "한국어 문장도 토크나이저 학습에 포함됩니다.",
    "Emoji test: 😀🚀🎉 and a family 👨‍👩‍👧 with flags 🇫🇷🇯🇵.",
    "def add(x, y):\n    return x + y\n",
    'print("The answer is", 42)  # comment',
    "Numbers like 3.14159, 2048 and 1,000,000 appear in text.",
    "User: what is the capital of France?\nAssistant: Paris.",
)

_ONSETS = ("", "b", "br", "c", "ch", "d", "f", "g", "gr", "h", "k", "l", "m", "n", "p", "pl", "qu", "r",
           "s", "sh", "st", "t", "th", "tr", "v", "w", "z")
_NUCLEI = ("a", "e", "i", "o", "u", "ai", "ea", "ou", "y")
_CODAS = ("", "", "", "n", "r", "s", "t", "l", "m", "ng", "ck", "x")
_PUNCT = (".", ".", ".", "!", "?", ",", ";", ":")


def _pseudo_word(rng: random.Random) -> str:
    # Invented words give BPE an open-ended supply of new merges, so even an 8k vocab fills up
    # from a corpus small enough to train in a second or two.
    return "".join(rng.choice(_ONSETS) + rng.choice(_NUCLEI) + rng.choice(_CODAS)
                   for _ in range(rng.randint(1, 4)))


def _line(rng: random.Random) -> str:
    roll = rng.random()
    if roll < 0.15:
        return rng.choice(_SENTENCES)
    words = []
    for _ in range(rng.randint(4, 16)):
        kind = rng.random()
        if kind < 0.55:
            words.append(rng.choice(_WORDS))
        elif kind < 0.80:
            words.append(_pseudo_word(rng))
        elif kind < 0.93:
            words.append(rng.choice(_FOREIGN_WORDS))
        else:
            words.append(str(rng.randint(0, 99999)))
    words[0] = words[0].capitalize()
    return " ".join(words) + rng.choice(_PUNCT)


def corpus(n_lines: int, seed: int = 0) -> list[str]:
    """Return `n_lines` lines of seeded pseudo-text mixing English, accented Latin, CJK and emoji."""
    rng = random.Random(seed)
    return [_line(rng) for _ in range(n_lines)]
