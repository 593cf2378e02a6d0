"""What the Whisper adapter, the speech route and `attnlab prepare` (attnlab_prepare.py) share without loading a
model: the special token ids of a Whisper vocabulary, the log-mel front end, and the text of the bundled sample
clip. No web imports; tokenizers and transformers are imported where used."""
from __future__ import annotations

import dataclasses
from pathlib import Path

# The bundled speech sample, spoken by Debian's espeak-ng (voice "en", 150 words per minute: 6.675 s).
SPEECH_SAMPLE_TEXT = ("Seven curious gulls watched the harbour at dawn. "
                      "Attention lets every word look at every other word.")


@dataclasses.dataclass(frozen=True)
class WhisperTokens:
    """Whisper's special token ids, read from the model's tokenizer.json (they differ between the English-only and
    the multilingual vocabularies: <|endoftext|> is 50256 in tiny.en, 50257 in base)."""

    eot: int
    sot: int
    no_timestamps: int
    transcribe: int | None  # None: an English-only model (no task or language tokens)
    translate: int | None
    languages: dict[str, int]  # "en" → <|en|>'s id; empty for an English-only model

    @property
    def multilingual(self) -> bool:
        return bool(self.languages) and self.transcribe is not None

    def prompt(self, language: str | None = None, task: str = "transcribe") -> list[int]:
        """The decoder's prompt: <|startoftranscript|> [<|lang|> <|task|>] <|notimestamps|>."""
        if not self.multilingual:
            return [self.sot, self.no_timestamps]
        return [self.sot, self.languages[language or "en"], self.translate if task == "translate" else self.transcribe,
                self.no_timestamps]


def whisper_tokens(tokenizer_json: Path, n_vocab: int, lang_ids: list[int] | None = None) -> WhisperTokens:
    """The special ids from tokenizer.json; `n_vocab`: the model's embedding rows; `lang_ids` (CTranslate2's
    config.json) are the language tokens of a multilingual model (an English-only vocabulary lists them too, but
    the model never saw them)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_json))

    def need(token: str) -> int:
        index = tokenizer.token_to_id(token)
        if index is None:
            raise SystemExit(f"{tokenizer_json}: no {token} token")
        return index

    eot = need("<|endoftext|>")
    # OpenAI's rule: a model with 51,865 or more token embeddings is multilingual (tiny.en has 51,864)
    multilingual = n_vocab >= 51865
    languages: dict[str, int] = {}
    if multilingual:
        for index in lang_ids or []:
            name = tokenizer.id_to_token(index) or ""
            if not (name.startswith("<|") and name.endswith("|>")):
                raise SystemExit(f"{tokenizer_json}: language id {index} is {name!r}, not a <|xx|> token")
            languages[name[2:-2]] = index
    return WhisperTokens(eot=eot, sot=need("<|startoftranscript|>"), no_timestamps=need("<|notimestamps|>"),
                         transcribe=need("<|transcribe|>") if multilingual else None,
                         translate=need("<|translate|>") if multilingual else None, languages=languages)


def whisper_feature_extractor():
    """Whisper's log-mel front end with its parameters spelled out (no hub): 80 mel bins, 25 ms windows every
    10 ms at 16 kHz, 30 s chunks (3,000 frames)."""
    from transformers import WhisperFeatureExtractor

    return WhisperFeatureExtractor(feature_size=80, sampling_rate=16000, hop_length=160, chunk_length=30, n_fft=400)
