"""POST /tokenize and /detokenize (vLLM's): agents count a conversation's tokens against the context before
they send it, with the server's own tokenizer and chat template."""

from __future__ import annotations

from aiohttp import web

from worker.protocol import (
    ChatCompletionRequest, DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse, parse_request,
)
from worker.served_model import ServedModel
from worker.serving import STATE, check_model, check_token_ids, read_payload
from worker.serving_chat import chat_prompt


async def tokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    model: ServedModel = state.require_model()
    payload = await read_payload(request)
    body = parse_request(TokenizeRequest, payload)
    check_model(body.model, model)
    if body.messages is not None:  # the chat completion's prompt, from the same fields, images expanded
        chat = parse_request(ChatCompletionRequest, payload)
        ids = (await chat_prompt(chat, model, state.settings, body.add_generation_prompt, body.add_special_tokens)).ids
    else:
        ids = model.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    strs = [model.tokenizer.id_to_token(i) for i in ids] if body.return_token_strs else None
    return web.json_response(TokenizeResponse(count=len(ids), max_model_len=model.max_model_len, tokens=ids,
                                              token_strs=strs).model_dump())


async def detokenize(request: web.Request) -> web.Response:
    model: ServedModel = request.app[STATE].require_model()
    body = parse_request(DetokenizeRequest, await read_payload(request))
    check_model(body.model, model)
    check_token_ids(body.tokens, model, "tokens")
    text = model.tokenizer.decode(body.tokens, skip_special_tokens=False)
    return web.json_response(DetokenizeResponse(prompt=text).model_dump())
