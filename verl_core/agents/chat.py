"""How an episode's messages become tokens: the prompt with the tools' schemas, and the tokens the
environment appends after a policy turn that called tools.

With a chat template (every instruct model, and the embedded default's ``<|role|>\\ncontent<|end|>\\n``)
the prompt is ``apply_chat_template(messages, tools=[schemas], add_generation_prompt=True)``, the
Hugging Face convention that Qwen / Hermes / Llama templates render into their system prompt (a
template without tool support, like the embedded default's, ignores ``tools``). The tool turn is
what the template adds after the assistant's end-of-turn token for ``{"role": "tool", "content": r}``
messages plus the next assistant header: rendered once with and once without them after a dummy
dialogue, and the difference taken from the end of the assistant message (its EOS, which the policy
sampled itself). For the embedded default that is ``\\n<|tool|>\\n{result}<|end|>\\n<|assistant|>\\n``,
for Qwen2.5 ``\\n<|im_start|>user\\n<tool_response>\\n{result}\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n``.

Without a chat template (a base model) the prompt is the plain text, and each tool answer is
appended as ``\\n<tool_response>\\n{result}\\n</tool_response>\\n`` after the policy's EOS.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from verl_core.agents.tools import ToolResult

Messages = list[dict[str, Any]]
_DUMMY: Messages = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]


class ChatFormat:
    """Prompt and tool-turn tokens for ``tokenizer`` and the tool ``schemas`` (``Tool.schema()``)."""

    def __init__(self, tokenizer, schemas: Sequence[dict] = (), system_prompt: str | None = None):
        self.tok = tokenizer
        self.schemas = list(schemas) or None
        self.system_prompt = system_prompt
        self.templated = bool(getattr(tokenizer, "chat_template", None))
        self._cut: int | None = None
        if self.templated:
            before = self._render(_DUMMY, generation=False)
            eos = tokenizer.eos_token or ""
            end = before.rfind(eos) if eos else -1
            self._cut = end + len(eos) if end >= 0 else len(before)

    def _render(self, messages: Messages, generation: bool) -> str:
        return self.tok.apply_chat_template(messages, tools=self.schemas, tokenize=False, add_generation_prompt=generation)

    def messages(self, prompt: str | Messages) -> Messages:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        if self.system_prompt and messages[0].get("role") != "system":
            messages = [{"role": "system", "content": self.system_prompt}, *messages]
        return messages

    def prompt_text(self, prompt: str | Messages) -> str:
        if self.templated:
            return self._render(self.messages(prompt), generation=True)
        if isinstance(prompt, str):
            return (self.system_prompt + "\n" if self.system_prompt else "") + prompt
        return "\n".join(m["content"] for m in self.messages(prompt))

    def prompt_ids(self, prompt: str | Messages) -> list[int]:
        return self.tok(self.prompt_text(prompt), add_special_tokens=not self.templated)["input_ids"]

    def tool_text(self, results: Sequence[ToolResult]) -> str:
        """The text the environment appends after a policy turn (ended by its EOS) that called tools."""
        if not self.templated:
            return "\n" + "".join(f"<tool_response>\n{r.text}\n</tool_response>\n" for r in results)
        after = self._render(_DUMMY + [{"role": "tool", "content": r.text} for r in results], generation=True)
        return after[self._cut :]

    def tool_ids(self, results: Sequence[ToolResult]) -> list[int]:
        return self.tok(self.tool_text(results), add_special_tokens=False)["input_ids"]
