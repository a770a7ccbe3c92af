"""A tool-calling chat template for SmolLM2 (and the kit's tiny models, which share its tokenizer), and the check
that a tokenizer can carry a tool conversation.

SmolLM2-Instruct's own template is plain ChatML: it drops ``tool_calls`` and tool messages, and its tokenizer has no
response parser, so TRL's tool loop cannot read a call back. ``SMOLLM2_TOOL_TEMPLATE`` keeps SmolLM2's ChatML turns
and default system prompt and adds Qwen2.5's tool conventions (the JSON function signatures in ``<tools>`` in the
system turn, a call as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, results as
``<tool_response>`` in a user turn), so ``TOOL_RESPONSE_TEMPLATE`` (the same fields as TRL's Qwen3 parser) parses
its calls. It is prefix-preserving: a turn renders the same whatever follows it, which TRL's multi-turn loop needs.
"""

from __future__ import annotations

SMOLLM2_DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

SMOLLM2_TOOL_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}{%- set system = messages[0]['content'] %}"
    "{%- else %}{%- set system = '" + SMOLLM2_DEFAULT_SYSTEM + "' %}{%- endif %}"
    "{{- '<|im_start|>system\\n' + system }}"
    "{%- if tools %}"
    "{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": '
    "<args-json-object>}\\n</tool_call>' }}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role == 'assistant' and message.tool_calls %}"
    "{{- '<|im_start|>assistant' }}{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    '{{- \'\\n<tool_call>\\n{"name": "\' + tool_call.name + \'", "arguments": \' }}'
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# transformers' new-style response parser (tokenizer.response_template): the fields of TRL's Qwen3 parser without
# the reasoning block, which SmolLM2 has not.
TOOL_RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "tool_calls": {
            "open": "<tool_call>",
            "close_pattern": r"</tool_call>\s*",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": "{content}"},
        },
        "content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"},
    },
}

_NAME, _KEY, _VALUE, _RESULT = "tool_name_7f3a", "tool_key_1c9e", "tool_value_5b2d", "tool_result_8e4f"


def use_tool_template(tokenizer):
    """Give ``tokenizer`` (SmolLM2's ChatML vocabulary) the kit's tool-calling template and its response parser."""
    tokenizer.chat_template = SMOLLM2_TOOL_TEMPLATE
    tokenizer.response_template = TOOL_RESPONSE_TEMPLATE
    return tokenizer


def tool_template_problems(tokenizer) -> list[str]:
    """What ``tokenizer``'s chat template lacks for TRL's tool loop (empty: nothing): rendering the tool call's name
    and arguments, rendering tool results, a response parser (``response_template``) to read calls back."""
    if not getattr(tokenizer, "chat_template", None):
        return ["a chat template"]
    calls = [{"type": "function", "function": {"name": _NAME, "arguments": {_KEY: _VALUE}}}]
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": calls},
        {"role": "tool", "name": _NAME, "content": _RESULT},
    ]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False)
    except Exception as e:  # the template's own error is what it lacks
        return [f"rendering a tool conversation ({type(e).__name__}: {e})"]
    problems = []
    if not all(s in text for s in (_NAME, _KEY, _VALUE)):
        problems.append("rendering the assistant's tool_calls (name and arguments)")
    if _RESULT not in text:
        problems.append("rendering tool messages (role 'tool')")
    if getattr(tokenizer, "response_template", None) is None and getattr(tokenizer, "response_schema", None) is None:
        problems.append("a response parser (tokenizer.response_template) to read tool calls back")
    return problems


def check_tool_template(tokenizer, name: str) -> None:
    """Raise one ``ValueError`` naming the template of model ``name`` and what it lacks for tool calling."""
    problems = tool_template_problems(tokenizer)
    if problems:
        raise ValueError(
            f"the chat template of {name!r} cannot carry tool calls: it lacks "
            + "; ".join(problems)
            + ". Use a model whose template supports tools, or, for SmolLM2 and "
            "the kit's tiny models, the kit's template (grpo_kit.tasks.chat_template.use_tool_template; "
            "set by the app when tools are configured)."
        )


def tool_suffix_ids(tokenizer, tool_messages: list[dict]) -> list[int]:
    """Token ids that follow a tool-calling assistant turn (ending on its EOS) for ``tool_messages``: the rendered
    tool results and the next assistant header, as TRL 1.16's tool loop appends them (``_get_tool_suffix_ids``: the
    difference between a dummy conversation with and without the results, cut at the prefix's last EOS)."""
    calls = [{"type": "function", "function": {"name": tool_messages[0]["name"], "arguments": {}}}]
    dummy = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "", "tool_calls": calls}]
    prefix = tokenizer.apply_chat_template(dummy, add_generation_prompt=False, tokenize=True, return_dict=False)
    full = tokenizer.apply_chat_template(
        dummy + list(tool_messages), add_generation_prompt=True, tokenize=True, return_dict=False
    )
    eos = [i for i, t in enumerate(prefix) if t == tokenizer.eos_token_id]
    if eos:  # templates that close a turn with EOS + newline: the boundary is the EOS
        prefix = prefix[: eos[-1] + 1]
    if full[: len(prefix)] != prefix:
        raise ValueError(
            "the chat template is not prefix-preserving around tool results: the EOS-trimmed "
            "assistant turn is not a prefix of the turn followed by its tool results"
        )
    return full[len(prefix) :]
