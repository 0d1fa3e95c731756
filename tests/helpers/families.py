"""Chat-template and tokenizer fixtures for the model families people distil, built locally (no hub).

`TEMPLATES` holds each family's real chat template, copied character for character from a public copy of the
official tokenizer config (sources below, next to each text). `SPECIALS` describes the family's special tokens:
which are the instruct tokenizer's bos/eos/pad/unk, which ids its generation_config stops on, where the real
vocabulary keeps them, and whether the real tokenizer adds BOS when encoding with add_special_tokens=True.
`family_tokenizer` trains a small byte-level BPE with those specials and the template, and `family_model` builds a
tiny random causal LM of the family's architecture. `CHATS` are the conversations the tests render.

What the templates do with the CHATS (the tests pin these down):
- qwen3: an assistant turn after the last user message gets a think block, an empty one
  ("<think>\\n\\n</think>\\n\\n") if it has none; leading newlines of those turns' answers are stripped
  (content.lstrip('\\n')), while earlier assistant turns keep their text as written and lose any reasoning.
  Refuses nothing.
- llama3: writes `<|begin_of_text|>` itself, always writes a system header with "Cutting Knowledge Date: December
  2023" and "Today Date: 26 Jul 2024" (date_string's default), and trims every message. Refuses nothing
  (no role check).
- gemma: writes `<bos>` itself, names the assistant "model", trims every message; raises "System role not
  supported" on a system turn and "Conversation roles must alternate ..." on non-alternating roles.
- mistral: writes `<s>` itself; "[INST] " + user + "[/INST]" and " " + trimmed answer + "</s>"; the system message
  is only written into the LAST message when that is a user turn, so a chat ending with an assistant turn drops its
  system prompt; raises "After the optional system message, conversation roles must alternate ..." otherwise.
- chatml (Qwen2.5): writes the default system prompt "You are Qwen, created by Alibaba Cloud. You are a helpful
  assistant." when there is no system turn; content verbatim. Refuses nothing.
"""
import hashlib
import os

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import AutoTokenizer, GenerationConfig, PreTrainedTokenizerFast

# ---------------------------------------------------------------------------------------------------------------
# Templates. Each is the exact `chat_template` text; the comment says where the copy came from. The public copies
# are of HF tokenizer configs (llama.cpp's models/templates/*.jinja are fetched from the hub by its
# scripts/get_chat_template.py); where two independent copies were found they were compared and are identical.
# ---------------------------------------------------------------------------------------------------------------

# Qwen/Qwen3-0.6B (the whole Qwen3 hybrid-thinking family ships this template).
# Source: ye-NX/llama.cpp models/templates/Qwen-Qwen3-0.6B.jinja (commit b354d7c9ecb76c97c07098617cdebbdfffa2583e);
# identical to the string in huggingface/swift-jinja Tests/Templates/ChatTemplateTests.swift (testQwen3).
QWEN3_TEMPLATE = (
    "{%- if tools %}\n"
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0].role == 'system' %}\n"
    "        {{- messages[0].content + '\\n\\n' }}\n"
    "    {%- endif %}\n"
    "    {{- \"# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are prov"
    "ided with function signatures within <tools></tools> XML tags:\\n<tools>\" }}\n"
    "    {%- for tool in tools %}\n"
    "        {{- \"\\n\" }}\n"
    "        {{- tool | tojson }}\n"
    "    {%- endfor %}\n"
    "    {{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments w"
    "ithin <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\":"
    " <args-json-object>}\\n</tool_call><|im_end|>\\n\" }}\n"
    "{%- else %}\n"
    "    {%- if messages[0].role == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
    "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}\n"
    "{%- for message in messages[::-1] %}\n"
    "    {%- set index = (messages|length - 1) - loop.index0 %}\n"
    "    {%- if ns.multi_step_tool and message.role == \"user\" and not(message.content.startswith('<tool_respo"
    "nse>') and message.content.endswith('</tool_response>')) %}\n"
    "        {%- set ns.multi_step_tool = false %}\n"
    "        {%- set ns.last_query_index = index %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- for message in messages %}\n"
    "    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "    {%- elif message.role == \"assistant\" %}\n"
    "        {%- set content = message.content %}\n"
    "        {%- set reasoning_content = '' %}\n"
    "        {%- if message.reasoning_content is defined and message.reasoning_content is not none %}\n"
    "            {%- set reasoning_content = message.reasoning_content %}\n"
    "        {%- else %}\n"
    "            {%- if '</think>' in message.content %}\n"
    "                {%- set content = message.content.split('</think>')[-1].lstrip('\\n') %}\n"
    "                {%- set reasoning_content = message.content.split('</think>')[0].rstrip('\\n').split('<thi"
    "nk>')[-1].lstrip('\\n') %}\n"
    "            {%- endif %}\n"
    "        {%- endif %}\n"
    "        {%- if loop.index0 > ns.last_query_index %}\n"
    "            {%- if loop.last or (not loop.last and reasoning_content) %}\n"
    "                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\"
    "n</think>\\n\\n' + content.lstrip('\\n') }}\n"
    "            {%- else %}\n"
    "                {{- '<|im_start|>' + message.role + '\\n' + content }}\n"
    "            {%- endif %}\n"
    "        {%- else %}\n"
    "            {{- '<|im_start|>' + message.role + '\\n' + content }}\n"
    "        {%- endif %}\n"
    "        {%- if message.tool_calls %}\n"
    "            {%- for tool_call in message.tool_calls %}\n"
    "                {%- if (loop.first and content) or (not loop.first) %}\n"
    "                    {{- '\\n' }}\n"
    "                {%- endif %}\n"
    "                {%- if tool_call.function %}\n"
    "                    {%- set tool_call = tool_call.function %}\n"
    "                {%- endif %}\n"
    "                {{- '<tool_call>\\n{\"name\": \"' }}\n"
    "                {{- tool_call.name }}\n"
    "                {{- '\", \"arguments\": ' }}\n"
    "                {%- if tool_call.arguments is string %}\n"
    "                    {{- tool_call.arguments }}\n"
    "                {%- else %}\n"
    "                    {{- tool_call.arguments | tojson }}\n"
    "                {%- endif %}\n"
    "                {{- '}\\n</tool_call>' }}\n"
    "            {%- endfor %}\n"
    "        {%- endif %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    "    {%- elif message.role == \"tool\" %}\n"
    "        {%- if loop.first or (messages[loop.index0 - 1].role != \"tool\") %}\n"
    "            {{- '<|im_start|>user' }}\n"
    "        {%- endif %}\n"
    "        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n"
    "        {{- '\\n</tool_response>' }}\n"
    "        {%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}\n"
    "            {{- '<|im_end|>\\n' }}\n"
    "        {%- endif %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "    {%- if enable_thinking is defined and enable_thinking is false %}\n"
    "        {{- '<think>\\n\\n</think>\\n\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}"
)


# meta-llama/Llama-3.1-8B-Instruct (Llama-3.3-70B-Instruct ships the same text; Llama 3.2 differs: it takes the
# date from strftime_now, so it renders a different "Today Date" every day).
# Source: ye-NX/llama.cpp models/templates/meta-llama-Llama-3.3-70B-Instruct.jinja (commit b354d7c9ecb7...);
# identical to a Llama-3.1-8B-Instruct chat_template string vendored in another public repository (a
# distillation script whose repository name the search index did not show).
LLAMA3_TEMPLATE = (
    "{{- bos_token }}\n"
    "{%- if custom_tools is defined %}\n"
    "    {%- set tools = custom_tools %}\n"
    "{%- endif %}\n"
    "{%- if not tools_in_user_message is defined %}\n"
    "    {%- set tools_in_user_message = true %}\n"
    "{%- endif %}\n"
    "{%- if not date_string is defined %}\n"
    "    {%- set date_string = \"26 Jul 2024\" %}\n"
    "{%- endif %}\n"
    "{%- if not tools is defined %}\n"
    "    {%- set tools = none %}\n"
    "{%- endif %}\n"
    "\n"
    "{#- This block extracts the system message, so we can slot it into the right place. #}\n"
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {%- set system_message = messages[0]['content']|trim %}\n"
    "    {%- set messages = messages[1:] %}\n"
    "{%- else %}\n"
    "    {%- set system_message = \"\" %}\n"
    "{%- endif %}\n"
    "\n"
    "{#- System message + builtin tools #}\n"
    "{{- \"<|start_header_id|>system<|end_header_id|>\\n\\n\" }}\n"
    "{%- if builtin_tools is defined or tools is not none %}\n"
    "    {{- \"Environment: ipython\\n\" }}\n"
    "{%- endif %}\n"
    "{%- if builtin_tools is defined %}\n"
    "    {{- \"Tools: \" + builtin_tools | reject('equalto', 'code_interpreter') | join(\", \") + \"\\n\\n\"}}"
    "\n"
    "{%- endif %}\n"
    "{{- \"Cutting Knowledge Date: December 2023\\n\" }}\n"
    "{{- \"Today Date: \" + date_string + \"\\n\\n\" }}\n"
    "{%- if tools is not none and not tools_in_user_message %}\n"
    "    {{- \"You have access to the following functions. To call a function, please respond with JSON for a f"
    "unction call.\" }}\n"
    "    {{- 'Respond in the format {\"name\": function name, \"parameters\": dictionary of argument name and i"
    "ts value}.' }}\n"
    "    {{- \"Do not use variables.\\n\\n\" }}\n"
    "    {%- for t in tools %}\n"
    "        {{- t | tojson(indent=4) }}\n"
    "        {{- \"\\n\\n\" }}\n"
    "    {%- endfor %}\n"
    "{%- endif %}\n"
    "{{- system_message }}\n"
    "{{- \"<|eot_id|>\" }}\n"
    "\n"
    "{#- Custom tools are passed in a user message with some extra guidance #}\n"
    "{%- if tools_in_user_message and not tools is none %}\n"
    "    {#- Extract the first user message so we can plug it in here #}\n"
    "    {%- if messages | length != 0 %}\n"
    "        {%- set first_user_message = messages[0]['content']|trim %}\n"
    "        {%- set messages = messages[1:] %}\n"
    "    {%- else %}\n"
    "        {{- raise_exception(\"Cannot put tools in the first user message when there's no first user messag"
    "e!\") }}\n"
    "{%- endif %}\n"
    "    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}\n"
    "    {{- \"Given the following functions, please respond with a JSON for a function call \" }}\n"
    "    {{- \"with its proper arguments that best answers the given prompt.\\n\\n\" }}\n"
    "    {{- 'Respond in the format {\"name\": function name, \"parameters\": dictionary of argument name and i"
    "ts value}.' }}\n"
    "    {{- \"Do not use variables.\\n\\n\" }}\n"
    "    {%- for t in tools %}\n"
    "        {{- t | tojson(indent=4) }}\n"
    "        {{- \"\\n\\n\" }}\n"
    "    {%- endfor %}\n"
    "    {{- first_user_message + \"<|eot_id|>\"}}\n"
    "{%- endif %}\n"
    "\n"
    "{%- for message in messages %}\n"
    "    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}\n"
    "        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim"
    " + '<|eot_id|>' }}\n"
    "    {%- elif 'tool_calls' in message %}\n"
    "        {%- if not message.tool_calls|length == 1 %}\n"
    "            {{- raise_exception(\"This model only supports single tool-calls at once!\") }}\n"
    "        {%- endif %}\n"
    "        {%- set tool_call = message.tool_calls[0].function %}\n"
    "        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}\n"
    "            {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}\n"
    "            {{- \"<|python_tag|>\" + tool_call.name + \".call(\" }}\n"
    "            {%- for arg_name, arg_val in tool_call.arguments | items %}\n"
    "                {{- arg_name + '=\"' + arg_val + '\"' }}\n"
    "                {%- if not loop.last %}\n"
    "                    {{- \", \" }}\n"
    "                {%- endif %}\n"
    "                {%- endfor %}\n"
    "            {{- \")\" }}\n"
    "        {%- else  %}\n"
    "            {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}\n"
    "            {{- '{\"name\": \"' + tool_call.name + '\", ' }}\n"
    "            {{- '\"parameters\": ' }}\n"
    "            {{- tool_call.arguments | tojson }}\n"
    "            {{- \"}\" }}\n"
    "        {%- endif %}\n"
    "        {%- if builtin_tools is defined %}\n"
    "            {#- This means we're in ipython mode #}\n"
    "            {{- \"<|eom_id|>\" }}\n"
    "        {%- else %}\n"
    "            {{- \"<|eot_id|>\" }}\n"
    "        {%- endif %}\n"
    "    {%- elif message.role == \"tool\" or message.role == \"ipython\" %}\n"
    "        {{- \"<|start_header_id|>ipython<|end_header_id|>\\n\\n\" }}\n"
    "        {%- if message.content is mapping or message.content is iterable %}\n"
    "            {{- message.content | tojson }}\n"
    "        {%- else %}\n"
    "            {{- message.content }}\n"
    "        {%- endif %}\n"
    "        {{- \"<|eot_id|>\" }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    "{%- endif %}\n"
)


# google/gemma-2-2b-it (gemma-2-*-it; the same text as gemma-1.1-it).
# Source: ye-NX/llama.cpp models/templates/google-gemma-2-2b-it.jinja (commit b354d7c9ecb7...); identical to
# huggingface/swift-jinja Tests/Templates/ChatTemplateTests.swift (testGoogleGemma2bIt).
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{"
    "% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ ra"
    "ise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% if (m"
    "essage['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}{% endi"
    "f %}{{ '<start_of_turn>' + role + '\n"
    "' + message['content'] | trim + '<end_of_turn>\n"
    "' }}{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\n"
    "'}}{% endif %}"
)


# mistralai/Mistral-7B-Instruct-v0.3 (the tool-calling revision of its tokenizer_config.json).
# Source: two public copies whose repository names the search index did not show, both identical: a
# Python constant BAD_MISTRAL_CHAT_TEMPLATE and a Textual app's MISTRAL constant labelled
# "mistralai/Mistral-7B-Instruct-v0.3". Not found in a named repository: weaker provenance.
MISTRAL_TEMPLATE = (
    "{%- if messages[0][\"role\"] == \"system\" %}\n"
    "    {%- set system_message = messages[0][\"content\"] %}\n"
    "    {%- set loop_messages = messages[1:] %}\n"
    "{%- else %}\n"
    "    {%- set loop_messages = messages %}\n"
    "{%- endif %}\n"
    "{%- if not tools is defined %}\n"
    "    {%- set tools = none %}\n"
    "{%- endif %}\n"
    "{%- set user_messages = loop_messages | selectattr(\"role\", \"equalto\", \"user\") | list %}\n"
    "\n"
    "{#- This block checks for alternating user/assistant messages, skipping tool calling messages #}\n"
    "{%- set ns = namespace() %}\n"
    "{%- set ns.index = 0 %}\n"
    "{%- for message in loop_messages %}\n"
    "    {%- if not (message.role == \"tool\" or message.role == \"tool_results\" or (message.tool_calls is def"
    "ined and message.tool_calls is not none)) %}\n"
    "        {%- if (message[\"role\"] == \"user\") != (ns.index % 2 == 0) %}\n"
    "            {{- raise_exception(\"After the optional system message, conversation roles must alternate use"
    "r/assistant/user/assistant/...\") }}\n"
    "        {%- endif %}\n"
    "        {%- set ns.index = ns.index + 1 %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "\n"
    "{{- bos_token }}\n"
    "{%- for message in loop_messages %}\n"
    "    {%- if message[\"role\"] == \"user\" %}\n"
    "        {%- if tools is not none and (message == user_messages[-1]) %}\n"
    "            {{- \"[AVAILABLE_TOOLS] [\" }}\n"
    "            {%- for tool in tools %}\n"
    "                {%- set tool = tool.function %}\n"
    "                {{- '{\"type\": \"function\", \"function\": {' }}\n"
    "                {%- for key, val in tool.items() if key != \"return\" %}\n"
    "                    {%- if val is string %}\n"
    "                        {{- '\"' + key + '\": \"' + val + '\"' }}\n"
    "                    {%- else %}\n"
    "                        {{- '\"' + key + '\": ' + val|tojson }}\n"
    "                    {%- endif %}\n"
    "                    {%- if not loop.last %}\n"
    "                        {{- \", \" }}\n"
    "                    {%- endif %}\n"
    "                {%- endfor %}\n"
    "                {{- \"}}\" }}\n"
    "                {%- if not loop.last %}\n"
    "                    {{- \", \" }}\n"
    "                {%- else %}\n"
    "                    {{- \"]\" }}\n"
    "                {%- endif %}\n"
    "            {%- endfor %}\n"
    "            {{- \"[/AVAILABLE_TOOLS]\" }}\n"
    "            {%- endif %}\n"
    "        {%- if loop.last and system_message is defined %}\n"
    "            {{- \"[INST] \" + system_message + \"\\n\\n\" + message[\"content\"] + \"[/INST]\" }}\n"
    "        {%- else %}\n"
    "            {{- \"[INST] \" + message[\"content\"] + \"[/INST]\" }}\n"
    "        {%- endif %}\n"
    "    {%- elif message.tool_calls is defined and message.tool_calls is not none %}\n"
    "        {{- \"[TOOL_CALLS] [\" }}\n"
    "        {%- for tool_call in message.tool_calls %}\n"
    "            {%- set out = tool_call.function|tojson %}\n"
    "            {{- out[:-1] }}\n"
    "            {%- if not tool_call.id is defined or tool_call.id|length != 9 %}\n"
    "                {{- raise_exception(\"Tool call IDs should be alphanumeric strings with length 9!\") }}\n"
    "            {%- endif %}\n"
    "            {{- ', \"id\": \"' + tool_call.id + '\"}' }}\n"
    "            {%- if not loop.last %}\n"
    "                {{- \", \" }}\n"
    "            {%- else %}\n"
    "                {{- \"]\" + eos_token }}\n"
    "            {%- endif %}\n"
    "        {%- endfor %}\n"
    "    {%- elif message[\"role\"] == \"assistant\" %}\n"
    "        {{- \" \" + message[\"content\"]|trim + eos_token}}\n"
    "    {%- elif message[\"role\"] == \"tool_results\" or message[\"role\"] == \"tool\" %}\n"
    "        {%- if message.content is defined and message.content.content is defined %}\n"
    "            {%- set content = message.content.content %}\n"
    "        {%- else %}\n"
    "            {%- set content = message.content %}\n"
    "        {%- endif %}\n"
    "        {{- '[TOOL_RESULTS] {\"content\": ' + content|string + \", \" }}\n"
    "        {%- if not message.tool_call_id is defined or message.tool_call_id|length != 9 %}\n"
    "            {{- raise_exception(\"Tool call IDs should be alphanumeric strings with length 9!\") }}\n"
    "        {%- endif %}\n"
    "        {{- '\"call_id\": \"' + message.tool_call_id + '\"}[/TOOL_RESULTS]' }}\n"
    "    {%- else %}\n"
    "        {{- raise_exception(\"Only user and assistant roles are supported, with the exception of an initia"
    "l optional system message!\") }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
)


# Qwen/Qwen2.5-0.5B-Instruct (all Qwen2.5 instruct models): ChatML with the default system prompt.
# Source: huggingface/swift-jinja Tests/Templates/ChatTemplateTests.swift (testQwenQwen2_5_0_5BInstruct,
# commit 0571ff61766bb18f22c6b2c10491ec3c533e2cae).
CHATML_TEMPLATE = (
    "{%- if tools %}\n"
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n"
    "    {%- else %}\n"
    "        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}\n"
    "    {%- endif %}\n"
    "    {{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou ar"
    "e provided with function signatures within <tools></tools> XML tags:\\n<tools>\" }}\n"
    "    {%- for tool in tools %}\n"
    "        {{- \"\\n\" }}\n"
    "        {{- tool | tojson }}\n"
    "    {%- endfor %}\n"
    "    {{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments w"
    "ithin <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\":"
    " <args-json-object>}\\n</tool_call><|im_end|>\\n\" }}\n"
    "{%- else %}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "    {%- else %}\n"
    "        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im"
    "_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) or (message.role "
    "== \"assistant\" and not message.tool_calls) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "    {%- elif message.role == \"assistant\" %}\n"
    "        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n"
    "            {{- '\\n' + message.content }}\n"
    "        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n"
    "            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n"
    "            {%- endif %}\n"
    "            {{- '\\n<tool_call>\\n{\"name\": \"' }}\n"
    "            {{- tool_call.name }}\n"
    "            {{- '\", \"arguments\": ' }}\n"
    "            {{- tool_call.arguments | tojson }}\n"
    "            {{- '}\\n</tool_call>' }}\n"
    "        {%- endfor %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    "    {%- elif message.role == \"tool\" %}\n"
    "        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != \"tool\") %}\n"
    "            {{- '<|im_start|>user' }}\n"
    "        {%- endif %}\n"
    "        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n"
    "        {{- '\\n</tool_response>' }}\n"
    "        {%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}\n"
    "            {{- '<|im_end|>\\n' }}\n"
    "        {%- endif %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)

TEMPLATES = {"qwen3": QWEN3_TEMPLATE, "llama3": LLAMA3_TEMPLATE, "gemma": GEMMA_TEMPLATE, "mistral": MISTRAL_TEMPLATE,
             "chatml": CHATML_TEMPLATE}

QWEN2_PRETOKENIZE_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                           r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")   # transformers' Qwen2Tokenizer PRETOKENIZE_REGEX

# ---------------------------------------------------------------------------------------------------------------
# Special tokens. "specials" are registered as special tokens, in the real vocabulary's order; "added" are added
# tokens that the real tokenizer does NOT mark special (Qwen's <think>, <tool_call>, ...). "position": where the
# real vocab keeps them ("start": ids 0.., as Gemma and Mistral; "end": after the BPE vocab, as Qwen and Llama 3).
# bos/eos/pad/unk: the instruct tokenizer's; generation_eos: generation_config.json's eos_token_id list, as tokens.
# "base": what the base (pretrained) checkpoint's tokenizer / generation_config change.
# add_bos: the real tokenizer prepends BOS when encoding with add_special_tokens=True (Llama 3, Gemma, Mistral do;
# their templates also write the BOS text, so rendered chats must be encoded with add_special_tokens=False).
# ---------------------------------------------------------------------------------------------------------------
SPECIALS = {
    "qwen3": {
        "model": "Qwen/Qwen3-8B",
        "specials": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        "added": ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"],
        "position": "end", "pretokenizer": "qwen2", "add_bos": False,
        "bos": None, "eos": "<|im_end|>", "pad": "<|endoftext|>", "unk": None,
        "generation_bos": "<|endoftext|>", "generation_eos": ["<|im_end|>", "<|endoftext|>"],
        "generation_pad": "<|endoftext|>",
        "base": {"eos": "<|endoftext|>", "generation_eos": ["<|endoftext|>"]},          # Qwen/Qwen3-8B-Base
        "arch": "qwen3",
    },
    "llama3": {
        "model": "meta-llama/Llama-3.1-8B-Instruct",
        "specials": ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                     "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|reserved_special_token_2|>",
                     "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"],
        "added": [],
        "position": "end", "pretokenizer": "bytelevel", "add_bos": True,
        "bos": "<|begin_of_text|>", "eos": "<|eot_id|>", "pad": None, "unk": None,   # no pad token, as released
        "generation_bos": "<|begin_of_text|>", "generation_eos": ["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"],
        "generation_pad": None,
        "base": {"eos": "<|end_of_text|>", "generation_eos": ["<|end_of_text|>"]},     # meta-llama/Llama-3.1-8B
        "arch": "llama",
    },
    "gemma": {
        "model": "google/gemma-2-2b-it",
        "specials": ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"],
        "added": [],
        "position": "start", "pretokenizer": "bytelevel", "add_bos": True,
        "bos": "<bos>", "eos": "<eos>", "pad": "<pad>", "unk": "<unk>",
        "generation_bos": "<bos>", "generation_eos": ["<eos>", "<end_of_turn>"], "generation_pad": "<pad>",
        "base": {"generation_eos": ["<eos>"]},                                          # google/gemma-2-2b
        "arch": "gemma2",
    },
    "mistral": {
        "model": "mistralai/Mistral-7B-Instruct-v0.3",
        "specials": ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]",
                     "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"],
        "added": [],
        "position": "start", "pretokenizer": "bytelevel", "add_bos": True,
        "bos": "<s>", "eos": "</s>", "pad": None, "unk": "<unk>",                      # no pad token, as released
        "generation_bos": "<s>", "generation_eos": ["</s>"], "generation_pad": None,
        "base": {},                                                                     # mistralai/Mistral-7B-v0.3
        "arch": "mistral",
    },
    "chatml": {
        "model": "Qwen/Qwen2.5-7B-Instruct",
        "specials": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        "added": ["<tool_call>", "</tool_call>"],
        "position": "end", "pretokenizer": "qwen2", "add_bos": False,
        "bos": None, "eos": "<|im_end|>", "pad": "<|endoftext|>", "unk": None,
        "generation_bos": "<|endoftext|>", "generation_eos": ["<|im_end|>", "<|endoftext|>"],
        "generation_pad": "<|endoftext|>",
        "base": {"eos": "<|endoftext|>", "generation_eos": ["<|endoftext|>"]},          # Qwen/Qwen2.5-7B
        "arch": "qwen2",
    },
}
FAMILIES = tuple(TEMPLATES)
FAMILY_ARCH = {name: spec["arch"] for name, spec in SPECIALS.items()}
TEMPLATE_SHA256 = {   # of the texts above, so an accidental edit of a template shows up in the tests
    "qwen3": "87a2728cb8dc9fe424d624542f6060ec05a1d285ebbec578bb078900e33396b5",
    "llama3": "e10ca381b1ccc5cf9db52e371f3b6651576caee0a630b452e2816b2d404d4b65",
    "gemma": "ecd6ae513fe103f0eb62e8ab5bfa8d0fe45c1074fa398b089c93a7e70c15cfd6",
    "mistral": "e16746b40344d6c5b5265988e0328a0bf7277be86f1c335156eae07e29c82826",
    "chatml": "cd8e9439f0570856fd70470bf8889ebd8b5d1107207f67a5efb46e342330527f",
}


def template_sha256(name):
    return hashlib.sha256(TEMPLATES[name].encode()).hexdigest()


def tokens_for(name, base=False):
    """The family's token roles for the instruct (or base) checkpoint: bos/eos/pad/unk and generation ids."""
    spec = SPECIALS[name]
    out = {k: spec[k] for k in ("bos", "eos", "pad", "unk", "generation_bos", "generation_eos", "generation_pad")}
    if base:
        out.update(spec["base"])
    return out


# ---------------------------------------------------------------------------------------------------------------
# Chats. Answers start with a newline, spaces, or code indentation, since templates differ in what they keep.
# ---------------------------------------------------------------------------------------------------------------
SYSTEM = {"role": "system", "content": "You extract skills. Be brief."}
CODE = "\n    def f():\n        return 1"
THINK = "<think>\nThe posting asks for containers and queries.\n</think>\n\ndocker, sql"


def _chat(name, *turns, system=False):
    msgs = [dict(SYSTEM)] if system else []
    for user, answer in turns:
        msgs.append({"role": "user", "content": user})
        if answer is not None:
            msgs.append({"role": "assistant", "content": answer})
    return {"name": name, "messages": msgs}


CHATS = [
    _chat("one_turn", ("List the skills: write joins over tables.", "sql")),
    _chat("system_one_turn", ("List the skills: containerize the services.", "docker"), system=True),
    _chat("two_turns", ("First posting: query relational databases.", "sql"),
          ("Second posting: run pods at scale.", "kubernetes")),
    _chat("system_three_turns", ("One: design interface mockups.", "figma"),
          ("Two: build business dashboards.", "tableau"),
          ("Three: review pull requests.", "git"), system=True),
    _chat("newline_answer", ("Answer on a new line.", "\nThe skills are python and sql.")),
    _chat("spaces_answer", ("Answer with padding.", "   aws, linux   ")),
    _chat("code_answer", ("Write a function returning one.", CODE)),
    _chat("code_then_newline", ("Write a function returning one.", CODE),
          ("Now answer on a new line.", "\nDone.")),
    _chat("think_answer", ("Which skills? Containerize services and query databases.", THINK)),
    _chat("think_two_turns", ("First: which skills?", "<think>\nFirst reasoning.\n</think>\n\nexcel"),
          ("Second: which skills?", "<think>\nSecond reasoning.\n</think>\n\nspark")),
    {"name": "non_alternating", "messages": [{"role": "user", "content": "First half of the posting."},
                                             {"role": "user", "content": "Second half: tune the kernel."},
                                             {"role": "assistant", "content": "linux"}]},
]
CHAT = {c["name"]: c["messages"] for c in CHATS}


def expected_refusal(name, messages):
    """The message the family's template raises for `messages` (a `jinja2.TemplateError`), or None if it renders.

    gemma: any system turn ("System role not supported"), then roles that do not alternate user/assistant;
    mistral: roles that do not alternate after an optional system message; qwen3, llama3, chatml: nothing."""
    roles = [m["role"] for m in messages]
    if name == "gemma" and roles and roles[0] == "system":
        return "System role not supported"
    body = roles[1:] if roles and roles[0] == "system" else roles
    alternating = all(r == ("user" if i % 2 == 0 else "assistant") for i, r in enumerate(body))
    if name in ("gemma", "mistral") and not alternating:
        return "roles must alternate user/assistant/user/assistant"
    return None


def corpus_texts():
    """Every message text of CHATS (tokenizer training material; add the demo corpus for more merges)."""
    return [m["content"] for c in CHATS for m in c["messages"]]


# ---------------------------------------------------------------------------------------------------------------
# Builders
# ---------------------------------------------------------------------------------------------------------------
def _backend(spec):
    tok = Tokenizer(models.BPE())
    if spec["pretokenizer"] == "qwen2":   # as transformers' Qwen2Tokenizer: "\n" merges with following whitespace
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece_backend(prefix):
    """A SentencePiece-style BPE as transformers converts the real ones: "\u2581" for a space, byte fallback for
    what the vocabulary lacks. prefix "": Gemma's (a normalizer replaces spaces, no dummy prefix); "first":
    Mistral v0.3's (a Metaspace pre-tokenizer that prepends "\u2581" to a text's first piece, which the decoder
    strips again); "every": Llama 2's and Mistral v0.1's (a normalizer that prepends it to every text segment
    between special tokens)."""
    tok = Tokenizer(models.BPE(byte_fallback=True, fuse_unk=True))
    if prefix == "first":
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    elif prefix == "every":    # Llama 2's and Mistral v0.1's legacy normalizer: every text segment is prefixed
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    else:
        tok.normalizer = normalizers.Replace(" ", "\u2581")
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return tok


def _with_byte_pieces(tok):
    """tok with the 256 byte-fallback pieces <0x00>..<0xFF> appended to its vocabulary (BpeTrainer makes none)."""
    import json
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    return Tokenizer.from_str(json.dumps(spec))


def family_tokenizer(name, out_dir, corpus, *, vocab_size=600, base=False, pieces="bytelevel"):
    """Train a byte-level BPE on `corpus` with family `name`'s special tokens and chat template, save it to out_dir
    (save_pretrained) with a generation_config.json holding the family's generation ids (as ids in this
    tokenizer), and return it reloaded from out_dir with AutoTokenizer.

    base=True gives the base checkpoint's roles (Llama 3: EOS <|end_of_text|>; Qwen: EOS <|endoftext|>); the template
    is kept so chats can still be rendered. Where the real tokenizer adds BOS on add_special_tokens=True (Llama 3,
    Gemma, Mistral) this one does too; add_special_tokens=False never adds one, so the BOS text the template writes
    stays the only BOS.

    pieces: "bytelevel" (the default), or SentencePiece-style pieces as the real Gemma ("sentencepiece"), Mistral
    v0.3 ("sentencepiece-prefix": a dummy-prefix space on a text's first piece) and Llama 2 / Mistral v0.1
    ("sentencepiece-legacy": one on every text segment) tokenizers have: _sentencepiece_backend."""
    spec, roles = SPECIALS[name], tokens_for(name, base=base)
    sp = pieces.startswith("sentencepiece")
    prefix = {"sentencepiece": "", "sentencepiece-prefix": "first", "sentencepiece-legacy": "every"}.get(pieces)
    if sp and prefix is None:
        raise ValueError(f"pieces: {pieces!r}; one of bytelevel, sentencepiece, sentencepiece-prefix, "
                         "sentencepiece-legacy")
    tok = _sentencepiece_backend(prefix) if sp else _backend(spec)
    front = spec["specials"] if spec["position"] == "start" else []
    n_end = 0 if front else len(spec["specials"])
    alphabet = {} if sp else {"initial_alphabet": pre_tokenizers.ByteLevel.alphabet()}
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - n_end - len(spec["added"]) - (256 if sp else 0),
                                  special_tokens=front, show_progress=False, **alphabet)
    tok.train_from_iterator(list(corpus), trainer)
    if sp:
        tok = _with_byte_pieces(tok)
    if not front:
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in spec["specials"]])
    if spec["added"]:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in spec["added"]])
    named = {roles[k] for k in ("bos", "eos", "pad", "unk") if roles[k]}
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=roles["bos"], eos_token=roles["eos"], pad_token=roles["pad"],
        unk_token=roles["unk"], extra_special_tokens=[t for t in spec["specials"] if t not in named],
        add_bos_token=spec["add_bos"], add_eos_token=False, clean_up_tokenization_spaces=False)
    hf.chat_template = TEMPLATES[name]
    os.makedirs(out_dir, exist_ok=True)
    hf.save_pretrained(out_dir)
    ids = hf.convert_tokens_to_ids
    eos = [ids(t) for t in roles["generation_eos"]]
    GenerationConfig(bos_token_id=ids(roles["generation_bos"]) if roles["generation_bos"] else None,
                     eos_token_id=eos if len(eos) > 1 else eos[0],
                     pad_token_id=ids(roles["generation_pad"]) if roles["generation_pad"] else None,
                     ).save_pretrained(out_dir)
    return AutoTokenizer.from_pretrained(out_dir)


def family_model(tok, out_dir, *, arch="qwen2", seed=0):
    """A tiny random-init causal LM for `tok` (hidden 64, 2 layers, head_dim 32, vocab len(tok), 512 positions,
    float32), saved with the tokenizer to out_dir. arch: "qwen2", "qwen3", "llama", "gemma2" (with Gemma 2's logit
    softcapping) or "mistral"; FAMILY_ARCH names each family's. The generation config is the tokenizer directory's
    generation_config.json when there is one (family_tokenizer writes it), else the tokenizer's EOS."""
    import torch
    import transformers
    classes = {"qwen2": "Qwen2", "qwen3": "Qwen3", "llama": "Llama", "gemma2": "Gemma2", "mistral": "Mistral"}
    if arch not in classes:
        raise ValueError(f"unknown arch {arch!r}; one of {sorted(classes)}")
    gen_dir = getattr(tok, "name_or_path", "") or ""
    if os.path.isfile(os.path.join(gen_dir, "generation_config.json")):
        gen = GenerationConfig.from_pretrained(gen_dir)
    else:
        gen = GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                               pad_token_id=tok.pad_token_id)
    kw = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=512,
              bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
              tie_word_embeddings=True, dtype="float32")
    if arch == "gemma2":
        kw.update(final_logit_softcapping=30.0, attn_logit_softcapping=50.0, query_pre_attn_scalar=32,
                  sliding_window=256)
    if arch == "mistral":
        kw.update(sliding_window=None)
    config_cls = getattr(transformers, classes[arch] + "Config")
    model_cls = getattr(transformers, classes[arch] + "ForCausalLM")
    cfg = config_cls(**kw)
    if arch == "gemma2":
        cfg._attn_implementation = "eager"   # softcapping is applied by the eager attention path
    torch.manual_seed(seed)
    model = model_cls(cfg).eval()
    model.generation_config = gen
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return model


def warm_model(model_dir, chats, steps=80, lr=3e-3):
    """A few SFT steps of the model in model_dir on `chats` rendered by its own template (saved in place): a random
    model's completions are blank or no UTF-8 at all; a warmed one writes answers, some of which end within a small
    budget."""
    import torch
    from transformers import AutoModelForCausalLM

    from kdcache.common.chat import chat_spans, end_of_turn_ids
    tok, model = AutoTokenizer.from_pretrained(model_dir), AutoModelForCausalLM.from_pretrained(model_dir)
    torch.manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    seqs = []
    for c in chats:                     # trained on the answers (their end of turn included) only
        ids, spans = chat_spans(tok, c, set(end_of_turn_ids(tok)))
        labels = torch.full((1, len(ids)), -100)
        for a, b in spans:
            labels[0, a:b] = torch.tensor(ids[a:b])
        seqs.append((torch.tensor([ids]), labels))
    model.train()
    for step in range(steps):
        ids, labels = seqs[step % len(seqs)]
        model(input_ids=ids, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval().save_pretrained(model_dir)
