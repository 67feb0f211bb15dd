"""Token ids of a conversation's pieces, from the chat template: the prompt, and the observation tokens
appended after an assistant turn.

The model's own tokens are never re-tokenized. The observation tokens after an assistant turn are
the template's rendering of what follows the assistant's content: the turn's closing (``\\n`` after
``<|im_end|>`` in ChatML, which the model did not write because it stopped at its EOS), the new
messages, and the next generation prompt. They are found by rendering the conversation with the
assistant content replaced by a sentinel, with and without the new messages, and taking the suffix;
this needs the template's *prefix property* (rendering more messages only appends text), which
:meth:`ChatRenderer.observation_ids` checks every time and refuses (:class:`TemplatePrefixError`)
when it does not hold, instead of guessing.
"""

from __future__ import annotations

from typing import Any, Sequence

from trajflow.envs.tool_format import plain_tools_block

#: Stands in for the assistant's content when rendering: a private-use character no template alters.
SENTINEL = "\ue000"


class TemplatePrefixError(ValueError):
    """The chat template's rendering of a longer conversation does not start with that of a shorter one."""


class ChatRenderer:
    """Renders conversations with a tokenizer's chat template.

    With a template that mentions ``tools`` the schemas are passed as ``tools=``; otherwise the
    plain tools block (:func:`trajflow.envs.tool_format.plain_tools_block`) is appended to the
    system message (a system message is added when the conversation has none).

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template.
        tools: OpenAI function schemas offered to the model (empty: none).
        eos_ids: ids that end an assistant turn (their text is where the template's closing starts).

    Raises:
        ValueError: the tokenizer has no chat template.
    """

    def __init__(self, tokenizer: Any, tools: Sequence[dict] = (), eos_ids: Sequence[int] = ()) -> None:
        template = getattr(tokenizer, "chat_template", None)
        if not template:
            raise ValueError("multi-turn rollouts need a tokenizer with a chat template (model.prompt_format=auto)")
        self.tokenizer = tokenizer
        self.tools = list(tools)
        self.native_tools = bool(self.tools) and "tools" in template
        self.eos_texts = sorted({tokenizer.decode([int(e)]) for e in eos_ids}, key=len, reverse=True)

    def with_tools(self, messages: Sequence[dict]) -> list[dict]:
        """``messages`` with the plain tools block in the system message (unchanged when the template
        takes ``tools=`` or there are no tools)."""
        out = [dict(m) for m in messages]
        if not self.tools or self.native_tools:
            return out
        block = plain_tools_block(self.tools)
        if out and out[0].get("role") == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{block}"
        else:
            out.insert(0, {"role": "system", "content": block})
        return out

    def text(self, messages: Sequence[dict], add_generation_prompt: bool) -> str:
        """The template's text for ``messages`` (already :meth:`with_tools`)."""
        kwargs = {"tools": self.tools} if self.native_tools else {}
        return self.tokenizer.apply_chat_template([_template_message(m) for m in messages], tokenize=False,
                                                  add_generation_prompt=add_generation_prompt, **kwargs)

    def encode(self, text: str) -> list[int]:
        """Token ids of template text (special tokens in the text are matched, none are added)."""
        return [int(t) for t in self.tokenizer(text, add_special_tokens=False)["input_ids"]]

    def prompt_ids(self, messages: Sequence[dict]) -> list[int]:
        """The first messages rendered with the generation prompt: ``prompt_ids`` of the row."""
        return self.encode(self.text(self.with_tools(messages), add_generation_prompt=True))

    def observation_ids(self, before: Sequence[dict], observations: Sequence[dict],
                        ended_with: int | bool | None) -> list[int]:
        """Tokens to append after an assistant turn: its closing, ``observations`` and the next generation prompt.

        Args:
            before: the conversation up to (not including) the assistant message, with the tools
                (:meth:`with_tools`).
            observations: the environment's messages after the assistant message.
            ended_with: the end-of-turn id the assistant's tokens end with, or ``None``. Only the text
                of that token is taken off the front of the template's closing, and only if the
                closing starts with it: a model that stops on ``<|endoftext|>`` where the template
                closes turns with ``<|im_end|>`` still gets ``<|im_end|>`` in its context. (``True``
                is read as the template's own end of turn, for callers that only know that the turn
                ended on one of ``eos_ids``.)

        Raises:
            TemplatePrefixError: the template does not have the prefix property for this conversation.
        """
        before = list(before)
        head = self.text(before, add_generation_prompt=True)
        turn = self.text(before + [{"role": "assistant", "content": SENTINEL}], add_generation_prompt=False)
        full = self.text(before + [{"role": "assistant", "content": SENTINEL}] + list(observations),
                         add_generation_prompt=True)
        if not (turn.startswith(head) and full.startswith(turn) and turn[len(head):].startswith(SENTINEL)):
            raise TemplatePrefixError(
                "the chat template does not render a longer conversation as an extension of a shorter one "
                "(or changes the assistant's content), so observation tokens cannot be appended without "
                "re-tokenizing the model's own text; multi-turn rollouts do not support this template")
        closing = turn[len(head) + len(SENTINEL):]
        if ended_with is True:
            generated = next((e for e in self.eos_texts if e and closing.startswith(e)), "")
        elif ended_with is None or ended_with is False:
            generated = ""
        else:
            generated = self.tokenizer.decode([int(ended_with)])
        if generated and closing.startswith(generated):
            closing = closing[len(generated):]
        return self.encode(closing + full[len(turn):])


def _template_message(m: dict) -> dict:
    """A message as templates expect it: role and content (tool calls are in the content, as written)."""
    return {"role": m["role"], "content": m.get("content") or ""}
