"""Incremental detokenization and stop-string handling for one request.

Text is produced token by token as the core streams ids. Byte-level BPE
tokens may end mid-character, and sentencepiece-style tokenizers drop a
leading space at the start of a decode, so naive per-token decoding is wrong:
the fast path uses the tokenizer's own `DecodeStream` (primed with the tail of
the prompt for context); tokenizers without a Rust backend use the
prefix/read-offset algorithm on token strings.

Stop strings are matched on the text here (the core only sees ids). Only the
newly added text, plus enough of the tail for a match to straddle tokens, is
searched; a streaming caller never sees characters that might still turn out
to be the start of a stop string.
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

from vllm_lite.core.messages import EngineCoreRequest

# Replacement char: a decode ending in it is an incomplete multi-byte character.
_INCOMPLETE = "\ufffd"
# How many prompt tokens at most prime the stream (context for the first output token).
_MAX_PRIME_TOKENS = 24
_MIN_PRIME_TOKENS = 4


def find_stop_string(
    output_text: str, new_char_count: int, stop: list[str], include_in_output: bool
) -> Optional[tuple[str, int]]:
    """Find the earliest stop string that ends inside the last `new_char_count` characters.

    Returns (stop string, length to truncate the text to), or None. The length
    is the start of the stop string, or its end when `include_in_output`.
    """
    if new_char_count <= 0 or not stop:
        return None
    best: Optional[tuple[int, str]] = None
    for s in stop:
        # A match must end in the new text, so it can start at most len(s)-1 chars before it.
        start = max(0, len(output_text) - new_char_count - len(s) + 1)
        idx = output_text.find(s, start)
        if idx != -1 and (best is None or idx < best[0]):
            best = (idx, s)
    if best is None:
        return None
    idx, s = best
    return s, idx + len(s) if include_in_output else idx


def stop_prefix_holdback(text: str, stop: list[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of some stop string.

    Those characters may still grow into a stop string, so they are not streamed yet.
    """
    longest = 0
    for s in stop:
        upto = min(len(s) - 1, len(text))
        for k in range(upto, longest, -1):
            if text.endswith(s[:k]):
                longest = k
                break
    return longest


class IncrementalDetokenizer:
    """Tracks output token ids only: the `detokenize=False` case, and the base of the text-producing ones."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.output_text = ""

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids)

    def update(self, new_token_ids: list[int], stop_terminated: bool) -> Optional[str]:
        """Add the core's new ids; return the stop string that ended the request, if any."""
        self.token_ids.extend(new_token_ids)
        return None

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        return ""

    # No stop strings: a one-id update can neither stop nor hold text back (the output processor's fast path).
    plain = True

    def step_plain(self, token_id: int) -> str:
        """`update([token_id], False)` then `get_next_output_text(False, True)` in one call; only when `plain`."""
        self.token_ids.append(token_id)
        return ""

    @staticmethod
    def from_new_request(
        tokenizer: Any, request: EngineCoreRequest, use_fast_decode: bool = True, use_byte_table: bool = True
    ) -> "IncrementalDetokenizer":
        """Pick the right detokenizer for a request and tokenizer.

        A fast tokenizer whose decoder is plain byte-level (GPT-2, Llama 3, Qwen) decodes from a table of
        token bytes (ByteLevelIncrementalDetokenizer: the same text as its DecodeStream, a quarter of the
        cost a token); `use_byte_table=False` keeps the DecodeStream.
        """
        if tokenizer is None or not request.sampling_params.detokenize:
            return IncrementalDetokenizer()
        backend = _rust_backend(tokenizer) if use_fast_decode else None
        if backend is not None:
            table = byte_level_table(backend) if use_byte_table else None
            if table is not None:
                return ByteLevelIncrementalDetokenizer(table, request)
            return FastIncrementalDetokenizer(tokenizer, backend, request)
        return SlowIncrementalDetokenizer(tokenizer, request)


def _rust_backend(tokenizer: Any) -> Any:
    """The `tokenizers.Tokenizer` behind a fast HF tokenizer (or a bare one), else None."""
    try:
        from tokenizers import Tokenizer
        from tokenizers.decoders import DecodeStream  # noqa: F401  (older tokenizers lack it)
    except ImportError:
        return None
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend if isinstance(backend, Tokenizer) else None


class _TextDetokenizer(IncrementalDetokenizer):
    """Shared text bookkeeping: stop strings, min_tokens, streamed-text offsets."""

    def __init__(self, request: EngineCoreRequest) -> None:
        super().__init__()
        params = request.sampling_params
        self.stop: list[str] = list(params.stop or [])  # type: ignore[arg-type]
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        self.skip_special_tokens = params.skip_special_tokens
        self.spaces_between_special_tokens = params.spaces_between_special_tokens
        # Hold-back only matters when a stop string would be cut out of the text.
        self._hold_back = bool(self.stop) and not self.include_stop_str_in_output
        self.plain = not self.stop
        self._streamed_upto = 0  # chars of output_text already handed out as deltas
        # Ids that gave no text yet (the start of a character that later ids complete): at the
        # finish they decode as they are, as the tokenizer's own decode of the whole output does.
        self._undecoded: list[int] = []

    def decode_next(self, token_id: int) -> str:
        raise NotImplementedError

    def decode_ids(self, token_ids: list[int]) -> str:
        """Plain decode of `token_ids` (the held-back tail when the request finishes)."""
        raise NotImplementedError

    def update(self, new_token_ids: list[int], stop_terminated: bool) -> Optional[str]:
        if not new_token_ids:
            return None
        if len(new_token_ids) == 1 and not stop_terminated and not self.min_tokens:
            # The decode step's case (one id, no stop token, no min_tokens): the loop below, unrolled.
            tid = new_token_ids[0]
            self.token_ids.append(tid)
            piece = self.decode_next(tid)
            if not piece:  # no new text: nothing for a stop string to end in
                self._undecoded.append(tid)
                return None
            if self._undecoded:
                self._undecoded = []
            check_from = len(self.output_text)
            self.output_text += piece
            if not self.stop:
                return None
            return self._find_stop(check_from)
        # The core ended on a stop token id (EOS / stop_token_ids): its text is not output
        # unless the caller asked to keep stop strings.
        skipped: Optional[int] = None
        if stop_terminated and not self.include_stop_str_in_output:
            skipped = new_token_ids[-1]
            new_token_ids = new_token_ids[:-1]

        check_from = len(self.output_text)
        for tid in new_token_ids:
            self.token_ids.append(tid)
            piece = self.decode_next(tid)
            self.output_text += piece
            if piece:
                self._undecoded = []
            else:
                self._undecoded.append(tid)
            if self.min_tokens and len(self.token_ids) <= self.min_tokens:
                # Stop strings may not end before min_tokens tokens exist.
                check_from = len(self.output_text)
        if skipped is not None:
            self.token_ids.append(skipped)

        if not self.stop or len(self.token_ids) <= self.min_tokens:
            return None
        return self._find_stop(check_from)

    def step_plain(self, token_id: int) -> str:
        # update()'s one-id branch with no stop strings (min_tokens only delays stop strings), then
        # get_next_output_text(finished=False, delta=True) with nothing held back.
        self.token_ids.append(token_id)
        piece = self.decode_next(token_id)
        return self._stream_piece(token_id, piece)

    def _stream_piece(self, token_id: int, piece: str) -> str:
        """step_plain's end: the new piece streamed (nothing held back), or the id kept while it decodes to nothing."""
        if not piece:
            self._undecoded.append(token_id)
            return ""
        if self._undecoded:
            self._undecoded = []
        start = self._streamed_upto
        text = self.output_text = self.output_text + piece
        end = self._streamed_upto = len(text)
        return piece if end - len(piece) == start else text[start:end]

    def _find_stop(self, check_from: int) -> Optional[str]:
        """A stop string ending in the text added past `check_from`: the text is cut there and it is returned."""
        hit = find_stop_string(
            self.output_text, len(self.output_text) - check_from, self.stop, self.include_stop_str_in_output
        )
        if hit is None:
            return None
        stop_str, truncate_to = hit
        self.output_text = self.output_text[:truncate_to]
        self._undecoded = []  # after the stop string: cut with the rest
        return stop_str

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The whole text so far (or the unseen piece, when `delta`), minus a possible stop-string start."""
        if finished and self._undecoded:  # the output ends inside a character: no later id completes it
            self.output_text += self.decode_ids(self._undecoded)
            self._undecoded = []
        end = len(self.output_text)
        if not finished and self._hold_back:
            end -= stop_prefix_holdback(self.output_text, self.stop)
        if not delta:
            return self.output_text[:end]
        start = self._streamed_upto
        if end <= start:
            return ""
        self._streamed_upto = end
        return self.output_text[start:end]


class FastIncrementalDetokenizer(_TextDetokenizer):
    """Uses `tokenizers.decoders.DecodeStream`, the tokenizer's own streaming decoder."""

    def __init__(self, tokenizer: Any, backend: Any, request: EngineCoreRequest) -> None:
        super().__init__(request)
        self.backend = backend
        self._prime_ids = _prompt_tail_for_context(backend, request.prompt_token_ids)
        self._new_stream()
        # With special tokens kept and spaces between them off, consecutive added tokens
        # are glued without any space the decoder might insert.
        self._added_tokens: dict[int, str] = {}
        self._last_was_added = False
        if not self.skip_special_tokens and not self.spaces_between_special_tokens:
            self._added_tokens = {tid: tok.content for tid, tok in backend.get_added_tokens_decoder().items()}

    def _new_stream(self) -> None:
        from tokenizers.decoders import DecodeStream

        self.stream = DecodeStream(skip_special_tokens=self.skip_special_tokens)
        for tid in self._prime_ids:
            self._step(tid)

    def _step(self, token_id: int) -> Optional[str]:
        try:
            return self.stream.step(self.backend, token_id)
        except Exception:
            self._restart_stream()
            return None

    def _restart_stream(self) -> None:
        # An id the tokenizer cannot decode (e.g. padded model vocab) or a broken
        # stream state: restart the stream so later tokens still decode.
        self._prime_ids = []
        from tokenizers.decoders import DecodeStream

        self.stream = DecodeStream(skip_special_tokens=self.skip_special_tokens)

    def decode_next(self, token_id: int) -> str:
        try:
            piece = self.stream.step(self.backend, token_id) or ""
        except Exception:  # as _step (inlined: one call less per token)
            self._restart_stream()
            piece = ""
        if self._added_tokens:
            content = self._added_tokens.get(token_id)
            if content is not None and self._last_was_added:
                piece = content
            self._last_was_added = content is not None
        return piece

    def decode_ids(self, token_ids: list[int]) -> str:
        try:
            return self.backend.decode(token_ids, skip_special_tokens=self.skip_special_tokens)
        except Exception:  # ids the tokenizer cannot decode gave no text while streaming either
            return ""


def _prompt_tail_for_context(backend: Any, prompt_ids: list[int]) -> list[int]:
    """A short prompt tail that decodes cleanly (no split character) to prime the stream with."""
    if len(prompt_ids) <= _MIN_PRIME_TOKENS:
        return list(prompt_ids)
    for n in range(_MIN_PRIME_TOKENS, min(len(prompt_ids), _MAX_PRIME_TOKENS) + 1):
        tail = prompt_ids[-n:]
        try:
            if _INCOMPLETE not in backend.decode(tail, skip_special_tokens=False):
                return list(tail)
        except Exception:
            return []
    return list(prompt_ids[-_MIN_PRIME_TOKENS:])


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte <-> printable character map (tokenizers' `bytes_char`), inverted: character -> byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    cs = list(bs)
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


_CHAR_BYTE = _byte_decoder()


class ByteLevelTable:
    """Token id -> the bytes a byte-level decoder turns it into, filled as ids are met (shared per tokenizer).

    The byte-level decoder maps each token's characters back to bytes (a token with a character outside the
    map, e.g. an added token with a space, stays its UTF-8 bytes), joins them and decodes them as UTF-8 with
    replacement; special tokens drop out when skipped and ids the tokenizer does not know give nothing. A
    decode of ids is therefore the lossy UTF-8 decode of their bytes joined, and it splits at every point
    where the text so far does not end in an incomplete character: DecodeStream's steps are pieces of it.
    """

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.special = {t.content for t in backend.get_added_tokens_decoder().values() if t.special}
        self.added = {tid: t.content for tid, t in backend.get_added_tokens_decoder().items()}
        self.by_skip: dict[bool, dict[int, bytes]] = {True: {}, False: {}}

    def bytes_of(self, token_id: int, skip_special_tokens: bool) -> Optional[bytes]:
        """The id's bytes (cached); None for an id the tokenizer rejects (DecodeStream raises on it)."""
        try:
            tok = self.backend.id_to_token(token_id)
        except Exception:
            return None
        if tok is None or (skip_special_tokens and tok in self.special):
            b = b""
        else:
            try:
                b = bytes([_CHAR_BYTE[c] for c in tok])
            except KeyError:
                b = tok.encode()
        self.by_skip[skip_special_tokens][token_id] = b
        return b


_BYTE_TABLES: "weakref.WeakKeyDictionary[Any, Optional[ByteLevelTable]]" = weakref.WeakKeyDictionary()


def byte_level_table(backend: Any) -> Optional[ByteLevelTable]:
    """The shared table of a `tokenizers.Tokenizer` whose decoder is exactly ByteLevel, else None."""
    try:
        return _BYTE_TABLES[backend]
    except KeyError:
        pass
    except TypeError:  # not weak-referenceable: no sharing
        return _new_byte_level_table(backend)
    table = _new_byte_level_table(backend)
    try:
        _BYTE_TABLES[backend] = table
    except TypeError:
        pass
    return table


def _new_byte_level_table(backend: Any) -> Optional[ByteLevelTable]:
    try:
        from tokenizers.decoders import ByteLevel
    except ImportError:
        return None
    if type(backend.decoder) is not ByteLevel:
        return None
    return ByteLevelTable(backend)


class ByteLevelIncrementalDetokenizer(FastIncrementalDetokenizer):
    """The byte-level decoder's stream as bytes: each id appends its bytes to the undecoded tail, which is
    emitted as soon as it decodes to text that does not end in a replacement character (DecodeStream's rule).

    The same pieces as FastIncrementalDetokenizer (primed with the same prompt tail), without a call into the
    Rust tokenizer per token: a dict lookup and a bytes decode. (A FastIncrementalDetokenizer without its
    DecodeStream: only the decode methods differ.)
    """

    def __init__(self, table: ByteLevelTable, request: EngineCoreRequest) -> None:
        _TextDetokenizer.__init__(self, request)
        self.table = table
        self.backend = table.backend
        self._bytes = table.by_skip[bool(self.skip_special_tokens)]
        self._pending = b""
        # As FastIncrementalDetokenizer: with special tokens kept and no spaces between them, consecutive
        # added tokens are glued as their contents.
        self._added_tokens: dict[int, str] = {}
        self._last_was_added = False
        if not self.skip_special_tokens and not self.spaces_between_special_tokens:
            self._added_tokens = table.added
        for tid in _prompt_tail_for_context(self.backend, request.prompt_token_ids):
            self._piece(tid)

    def _piece(self, token_id: int) -> str:
        b = self._bytes.get(token_id)
        if b is None:
            b = self.table.bytes_of(token_id, bool(self.skip_special_tokens))
            if b is None:  # DecodeStream raised: its stream restarts empty
                self._pending = b""
                return ""
        if self._pending:
            b = self._pending + b
        if not b:
            return ""
        try:
            text = b.decode()
        except UnicodeDecodeError:
            text = b.decode("utf-8", "replace")
        if text[-1] == _INCOMPLETE:
            self._pending = b
            return ""
        self._pending = b""
        return text

    def decode_next(self, token_id: int) -> str:
        piece = self._piece(token_id)
        if self._added_tokens:
            content = self._added_tokens.get(token_id)
            if content is not None and self._last_was_added:
                piece = content
            self._last_was_added = content is not None
        return piece

    def step_plain(self, token_id: int) -> str:
        # _TextDetokenizer.step_plain with the common case of _piece inlined: a known id, nothing pending.
        self.token_ids.append(token_id)
        b = self._bytes.get(token_id)
        if not b or self._pending or self._added_tokens:
            piece = self.decode_next(token_id)
        else:
            try:
                piece = b.decode()
            except UnicodeDecodeError:
                piece = b.decode("utf-8", "replace")
            if piece[-1] == _INCOMPLETE:
                self._pending = b
                piece = ""
        return self._stream_piece(token_id, piece)

    def decode_ids(self, token_ids: list[int]) -> str:
        try:
            return self.backend.decode(token_ids, skip_special_tokens=self.skip_special_tokens)
        except Exception:  # ids the tokenizer cannot decode gave no text while streaming either
            return ""


class SlowIncrementalDetokenizer(_TextDetokenizer):
    """Prefix/read-offset decoding over token strings, for tokenizers without a streaming decoder.

    Each step decodes the tokens from `prefix_offset` twice: without and with the
    new ones; the difference is the new text, emitted only once it no longer ends
    in an incomplete character.
    """

    def __init__(self, tokenizer: Any, request: EngineCoreRequest) -> None:
        super().__init__(request)
        self.tokenizer = tokenizer
        self.special_ids = set(getattr(tokenizer, "all_special_ids", []) or [])
        self.added_ids = set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
        prompt_tail = list(request.prompt_token_ids[-(_MIN_PRIME_TOKENS + 2) :])
        self.tokens: list[str] = self._to_tokens(prompt_tail)
        self.prefix_offset = max(len(self.tokens) - _MIN_PRIME_TOKENS, 0)
        self.read_offset = len(self.tokens)
        self._last_segment_added = False  # for spaces_between_special_tokens

    def _to_tokens(self, ids: list[int]) -> list[str]:
        out: list[str] = []
        for tid in ids:
            if self.skip_special_tokens and tid in self.special_ids:
                continue
            tok = self.tokenizer.convert_ids_to_tokens(tid)
            out.append(tok if tok is not None else "")
        return out

    def decode_next(self, token_id: int) -> str:
        if self.skip_special_tokens and token_id in self.special_ids:
            return ""
        if token_id in self.added_ids:
            # Added tokens decode to their content verbatim and cut the token run in two.
            tok = self.tokenizer.convert_ids_to_tokens(token_id) or ""
            sep = " " if self.spaces_between_special_tokens and (self.output_text or self._last_segment_added) else ""
            self.tokens.append(tok)
            self.prefix_offset = self.read_offset = len(self.tokens)
            self._last_segment_added = True
            return sep + tok
        self.tokens.extend(self._to_tokens([token_id]))
        prefix_text = self.tokenizer.convert_tokens_to_string(self.tokens[self.prefix_offset : self.read_offset])
        new_text = self.tokenizer.convert_tokens_to_string(self.tokens[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(_INCOMPLETE):
            return ""
        piece = new_text[len(prefix_text) :]
        if self._last_segment_added and self.spaces_between_special_tokens:
            piece = " " + piece
        self._last_segment_added = False
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.tokens)
        return piece

    def decode_ids(self, token_ids: list[int]) -> str:
        try:
            return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)
        except Exception:  # ids the tokenizer cannot decode gave no text while streaming either
            return ""
