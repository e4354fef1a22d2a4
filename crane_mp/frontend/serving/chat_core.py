"""What every chat-shaped API (OpenAI chat completions, the Responses API, Anthropic Messages) asks of
the engine, once translated: messages as the chat template reads them, tools and the choice among
them, an output constraint, sampling, and the thinking settings. `prepare_chat` renders the prompt,
forces tool calls or a format by grammar, sets the thinking budget, and gives the pipeline's Plan with
how to read the answers (answers.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

from crane_mp.frontend.images.chat import (
    check_takes_images,
    check_takes_videos,
    load_images,
    load_videos,
    place_images,
    record_images,
)
from crane_mp.frontend.openai.schemas import NamedFunction, NamedToolChoice
from crane_mp.frontend.serving.answers import ReasoningReading, ToolReading
from crane_mp.frontend.serving.harmony import TAGS as HARMONY_TAGS
from crane_mp.frontend.serving.pipeline import Plan, prompt_ids
from crane_mp.frontend.serving.reasoning import PLAIN, THINKING, prompt_opens_thinking, reading_mode, template_thinks
from crane_mp.frontend.serving.structured import Constraint
from crane_mp.frontend.state import FrontendState
from crane_mp.frontend.tools.forcing import forced_call_constraint
from crane_mp.frontend.tools.formats import ToolFormat, check_tools, tool_format, tool_prompt
from crane_mp.frontend.tools.gemma4_calls import MARKS as GEMMA4_MARKS
from crane_mp.frontend.web.errors import ApiError
from crane_mp.protocol import MediaInput, SamplingParams, ThinkingBudget


def named_tool(name: str) -> NamedToolChoice:
    """tool_choice naming one function, as the chat API writes it."""
    return NamedToolChoice("function", NamedFunction(name))


@dataclass(slots=True)
class ChatAsk:
    """A chat request of any API. `tool_choice`: none | auto | required, or one function (named_tool);
    `max_tokens` None: all the room the context leaves; `names`: what /abort_request may call it."""

    messages: list[dict[str, Any]]
    params: SamplingParams
    max_tokens: int | None
    names: str
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    constraint: Constraint | None = None
    stop: list[str] = field(default_factory=list)
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    separate_reasoning: bool = True
    thinking_budget: int | None = None
    n: int = 1
    skip_special_tokens: bool = True
    images: list[tuple[str, str]] = field(default_factory=list)  # (where, URL) of each image part, in order
    mm_processor_kwargs: dict[str, Any] | None = None  # the request's image processor settings
    videos: list[tuple[str, str]] = field(default_factory=list)  # (where, URL) of each video part, in order


@dataclass(slots=True)
class PreparedChat:
    plan: Plan
    input_ids: list[int]
    tools: ToolReading | None  # the answers are read for tool calls
    thinking: ReasoningReading | None  # the answers are read for thinking


@dataclass(slots=True)
class ChatPrompt:
    text: str
    ids: list[int]
    fmt: ToolFormat | None
    mode: str  # tool mode: none | auto | required | named
    only: str | None  # the named function


async def render_prompt(state: FrontendState, ask: ChatAsk) -> ChatPrompt:
    """The prompt `ask` renders to (tools checked against the model's call format), tokenized."""
    fmt = tool_format(state.config.tool_call_parser, state.engine_info.arch, state.tokenizer.marker_tokens,
                      state.tokenizer.xml_tool_calls)
    mode, only = check_tools(ask.tools, ask.tool_choice, fmt)
    prompt = state.tokenizer.render_chat(
        ask.messages, ask.add_generation_prompt, ask.continue_final_message, ask.chat_template_kwargs,
        ask.tools, tool_prompt(fmt, ask.tools) if ask.tools and fmt else None,
    )
    ids = await prompt_ids(state, prompt, "messages", add_special_tokens=False)
    return ChatPrompt(prompt, ids, fmt, mode, only)


async def prompt_with_images(state: FrontendState, ask: ChatAsk) -> tuple[ChatPrompt, list[int], list[MediaInput]]:
    """The rendered prompt, its token ids with each image's placeholders expanded, and the images."""
    check_takes_images(state, len(ask.images))
    check_takes_videos(state, len(ask.videos))
    images = []
    if ask.images:
        images = await load_images(state, ask.images, state.image_processor.settings(ask.mm_processor_kwargs))
    videos = await load_videos(state, ask.videos) if ask.videos else []
    rendered = await render_prompt(state, ask)
    if not images and not videos:
        return rendered, rendered.ids, []
    processor = state.image_processor
    if videos:  # Qwen3-VL's text, with timestamps, tokenized as its generate's is
        text = processor.expand_videos(rendered.text, images, videos)
        input_ids = await prompt_ids(state, text, "messages", add_special_tokens=False)
        return rendered, input_ids, processor.video_media(input_ids, images, videos)
    if processor.expands_text:  # Gemma 3: the processor's text, tokenized as its own generate's is
        text = processor.expand_text(rendered.text, images)
        input_ids = await prompt_ids(state, text, "messages", add_special_tokens=False)
        return rendered, input_ids, processor.crop_media(input_ids, images)
    input_ids, media = place_images(state, rendered.ids, images)
    return rendered, input_ids, media


async def prepare_chat(state: FrontendState, ask: ChatAsk) -> PreparedChat:
    rendered, input_ids, media = await prompt_with_images(state, ask)
    prompt, fmt, mode, only = rendered.text, rendered.fmt, rendered.mode, rendered.only
    if ask.images or ask.videos:  # the request's images and videos (not their crops or frame pairs)
        record_images(state, len(ask.images) + len(ask.videos))
    constraint = ask.constraint
    if mode in ("required", "named"):
        if constraint is not None:
            raise ApiError(400, f"tool_choice {mode} already constrains the output; drop {constraint.param}",
                           constraint.param)
        constraint = forced_call_constraint(fmt, ask.tools, only, ask.parallel_tool_calls,
                                            state.tokenizer.marker_tokens)
    params = await state.grammars.constrain(ask.params, constraint, state.engine_info)
    reading = ToolReading(fmt, ask.parallel_tool_calls, ask.tools) if mode != "none" else None
    # The sampler follows the think block (its tags must be tokens) for a budget, and for a constraint
    # after a prompt that opened thinking (R1): the constraint waits until the block ends. Otherwise a
    # constraint holds from the first token: the answer does not think (as with enable_thinking false).
    followable = None not in (state.think_start_token, state.think_end_token)
    markers = state.think_markers
    opens = prompt_opens_thinking(prompt, markers)
    mode = reading_mode(prompt, ask.continue_final_message,
                        template_thinks(state.config.reasoning_parser, state.tokenizer.template_variables), markers)
    if constraint is not None and not opens:
        mode = PLAIN
    split = state.reasoning and ask.separate_reasoning and (constraint is None or followable or not opens)
    thinking = ReasoningReading(mode, state.think_end_token, markers) if split else None
    budget = ask.thinking_budget
    if mode == PLAIN:
        budget = None
    elif budget is None and constraint is not None:  # leave the constrained answer half the room
        room = state.engine_info.max_model_len - len(input_ids)
        budget = min(room, ask.max_tokens or room) // 2
    if split and followable and budget is not None:  # the sampler counts the thinking as the reader reads it
        params = msgspec.structs.replace(params, thinking=ThinkingBudget(
            budget, state.think_start_token, state.think_end_token, mode == THINKING))
    kept = (GEMMA4_MARKS if reading is not None and fmt.gemma else ()) + (markers.tokens if thinking else ())
    if markers.harmony and (thinking or reading is not None):
        kept += HARMONY_TAGS
    plan = Plan([input_ids], params, ask.max_tokens, "messages", ask.n, ask.stop, ask.skip_special_tokens,
                names=ask.names, media=media, skip_ids=state.tokenizer.skip_ids(kept) if kept else None)
    return PreparedChat(plan, input_ids, reading, thinking)
