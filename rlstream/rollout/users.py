"""A simulated user population in front of the capture gateway (``rlstream up --traffic production``).

Users send the dataset's prompts through the gateway as real clients do: the OpenAI client (plain and
streamed) and, when installed, LangChain's ``ChatOpenAI``; some conversations have a second turn. Each
conversation is one gateway session (``X-Session-Id``) with the task header; it is ended right after its last
turn, and ``feedback_share`` of them get a reward (the task's reward function on the answer) after a random
delay in ``feedback_delay_s``; the others never do.

With an ``agent`` (an async ``(example, client, sampling, headers) -> output``, e.g. the OpenAI Agents SDK agent of
``rlstream.ops.tool_task:tool_agent``) each conversation is one run of that agent instead, its model calls in the
conversation's session, and the reward function scores the agent's output.
"""
from __future__ import annotations

import asyncio
import random
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import httpx

from rlstream.rollout.sampling import SamplingSettings
from rlstream.transport.log import get_logger

log = get_logger(__name__)
SESSION_HEADER = "X-Session-Id"
TASK_HEADER = "X-Rlstream-Task"
#: environment variable with the gateway's client key (``rlstream up`` sets it for the simulated users)
USERS_API_KEY_ENV = "RLSTREAM_GATEWAY_API_KEY"
#: ``async (example, client, sampling, headers) -> output``: an agent a simulated user runs through the gateway
Agent = Callable[[dict[str, Any], Any, SamplingSettings, dict[str, str]], Awaitable[Any]]


@dataclass(frozen=True)
class Population:
    """Who the simulated users are and how they behave."""

    concurrency: int = 8
    feedback_share: float = 0.7
    feedback_delay_s: tuple[float, float] = (5.0, 60.0)
    second_turn_share: float = 0.2
    stream_share: float = 0.3
    langchain_share: float = 0.2
    task: str = "toy"
    model: str = "toy"
    max_tokens: int = 12
    temperature: float = 1.0
    seed: int = 0


@dataclass
class UserStats:
    conversations: int = 0
    requests: int = 0
    streamed: int = 0
    langchain: int = 0
    feedback_sent: int = 0
    feedback_refused: int = 0
    errors: int = 0
    by_client: dict[str, int] = field(default_factory=dict)

    def figures(self) -> dict[str, int]:
        return {"users_conversations": self.conversations, "users_requests": self.requests,
                "users_streamed": self.streamed, "users_langchain": self.langchain,
                "users_feedback_sent": self.feedback_sent, "users_feedback_refused": self.feedback_refused,
                "users_errors": self.errors}


class UserPopulation:
    """Runs ``population.concurrency`` users until ``stop`` is set."""

    def __init__(self, gateway_url: str, examples: list[dict[str, Any]], reward_fn: Callable[[dict[str, Any], Any], Any],
                 population: Population, api_key: str | None = None, agent: Agent | None = None) -> None:
        if not examples:
            raise ValueError("the user population needs examples (a dataset)")
        self.base = gateway_url.rstrip("/")
        self.api_key = api_key  # the gateway's client key (with the inference and feedback scopes), if it has keys
        self.examples = examples
        self.reward_fn = reward_fn
        self.pop = population
        self.stats = UserStats()
        self.rng = random.Random(population.seed)
        self._feedback: set[asyncio.Task[None]] = set()
        self._langchain_ok = _langchain_available()
        self.agent = agent

    async def run(self, stop: asyncio.Event) -> UserStats:
        from openai import AsyncOpenAI

        auth = {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        async with httpx.AsyncClient(timeout=60.0, headers=auth) as http:
            client = AsyncOpenAI(base_url=f"{self.base}/v1", api_key=self.api_key or "none", http_client=http,
                                 max_retries=0)
            users = [asyncio.create_task(self._user(client, http, stop)) for _ in range(self.pop.concurrency)]
            await asyncio.gather(*users)
            for task in list(self._feedback):
                task.cancel()
            await asyncio.gather(*self._feedback, return_exceptions=True)
        return self.stats

    async def _user(self, client: Any, http: httpx.AsyncClient, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self._conversation(client, http)
            except Exception as exc:  # a failed call is a user's bad luck, never the population's end
                self.stats.errors += 1
                log.warning("simulated request failed", error=f"{type(exc).__name__}: {exc}")
                await asyncio.sleep(0.5)

    async def _conversation(self, client: Any, http: httpx.AsyncClient) -> None:
        example = self.rng.choice(self.examples)
        session = uuid.uuid4().hex
        headers = {SESSION_HEADER: session, TASK_HEADER: self.pop.task}
        messages: list[dict[str, Any]] = list(example.get("messages") or [{"role": "user", "content": example["prompt"]}])
        self.stats.conversations += 1
        if self.agent is not None:
            await self._agent_conversation(example, client, http, session, headers)
            return
        answer = await self._ask(client, messages, headers)
        if self.rng.random() < self.pop.second_turn_share:
            messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "Again, please."}]
            answer = await self._ask(client, messages, headers)
        await http.post(f"{self.base}/v1/sessions/{session}/end")
        self._maybe_feedback(http, session, example, answer)

    async def _agent_conversation(self, example: dict[str, Any], client: Any, http: httpx.AsyncClient, session: str,
                                  headers: dict[str, str]) -> None:
        assert self.agent is not None
        sampling = SamplingSettings(model=self.pop.model, temperature=self.pop.temperature,
                                    max_tokens=self.pop.max_tokens)
        self.stats.requests += 1
        output = await self.agent(example, client, sampling, headers)
        await http.post(f"{self.base}/v1/sessions/{session}/end")
        self._maybe_feedback(http, session, example, output)

    def _maybe_feedback(self, http: httpx.AsyncClient, session: str, example: dict[str, Any], output: Any) -> None:
        """Score ``output`` now and send it ``feedback_delay_s`` later, for ``feedback_share`` of the sessions."""
        from rlstream.rollout.runner import score

        if self.rng.random() < self.pop.feedback_share:
            reward, components = score(self.reward_fn(example, output))
            delay = self.rng.uniform(*self.pop.feedback_delay_s)
            task = asyncio.create_task(self._send_feedback(http, session, reward, delay, components))
            self._feedback.add(task)
            task.add_done_callback(self._feedback.discard)

    async def _ask(self, client: Any, messages: list[dict[str, Any]], headers: dict[str, str]) -> str:
        self.stats.requests += 1
        roll = self.rng.random()
        if self._langchain_ok and roll < self.pop.langchain_share:
            self.stats.langchain += 1
            return await self._ask_langchain(messages, headers)
        kwargs = {"model": self.pop.model, "messages": messages, "max_tokens": self.pop.max_tokens,
                  "temperature": self.pop.temperature, "extra_headers": headers}
        if roll < self.pop.langchain_share + self.pop.stream_share:
            self.stats.streamed += 1
            stream = await client.chat.completions.create(stream=True, **kwargs)
            parts = [chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices]
            return "".join(parts)
        response = await client.chat.completions.create(**kwargs)
        return response.choices[0].message.content or ""

    async def _ask_langchain(self, messages: list[dict[str, Any]], headers: dict[str, str]) -> str:
        from langchain_openai import ChatOpenAI

        chat = ChatOpenAI(model=self.pop.model, base_url=f"{self.base}/v1",  # type: ignore[arg-type]
                          api_key=self.api_key or "none",  # type: ignore[arg-type]
                          temperature=self.pop.temperature, max_tokens=self.pop.max_tokens,  # type: ignore[call-arg]
                          default_headers=headers, max_retries=0)
        reply = await chat.ainvoke([(m["role"], m["content"]) for m in messages])
        return str(reply.content)

    async def _send_feedback(self, http: httpx.AsyncClient, session: str, reward: float, delay_s: float,
                             components: dict[str, float] | None = None) -> None:
        """The reward with the reward function's components (the stream app counts the tool task's from them)."""
        await asyncio.sleep(delay_s)
        body: dict[str, object] = {"session_id": session, "reward": reward}
        if components:
            body["components"] = {k: v for k, v in components.items() if k != "reward"}
        response = await http.post(f"{self.base}/v1/feedback", json=body)
        if response.status_code == 202:
            self.stats.feedback_sent += 1
        else:
            self.stats.feedback_refused += 1
            log.warning("feedback refused", status=response.status_code, body=response.text[:200])


def _langchain_available() -> bool:
    try:
        import langchain_openai  # noqa: F401
    except ImportError:
        return False
    return True


async def report_every(stats: UserStats, seconds: float, stop: asyncio.Event,
                       sink: Callable[[dict[str, int]], Any] | None = None) -> None:
    """Log (and hand to ``sink``) the population's figures every ``seconds`` until ``stop``."""
    started = time.monotonic()
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), timeout=seconds)
        except asyncio.TimeoutError:
            pass
        figures = stats.figures()
        log.info("simulated users", seconds=round(time.monotonic() - started), **figures)
        if sink is not None:
            try:
                await sink(figures)
            except Exception as exc:  # noqa: BLE001 - figures are for the live view only
                log.warning("user figures not written", error=str(exc))
