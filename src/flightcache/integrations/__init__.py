"""flightcache where LLM developers already are: the OpenAI and Anthropic SDK clients.

- ``flightcache.integrations.openai.coalesce(client, fc)``: an ``openai.OpenAI`` /
  ``openai.AsyncOpenAI`` client whose ``chat.completions``, ``completions``, ``embeddings``
  and ``responses`` ``create`` calls are coalesced and cached across processes
  (``pip install 'flightcache[openai]'``).
- ``flightcache.integrations.anthropic.coalesce(client, fc)``: the same for an
  ``anthropic.Anthropic`` / ``anthropic.AsyncAnthropic`` client's ``messages.create``
  (``pip install 'flightcache[anthropic]'``).

The private modules hold what the gateway (``flightcache serve``) shares with them, with no
SDK nor HTTP stack: the key and policy rules of a model request (``_rules``), and the
stored form of an answer (``_answers``, ``_chat``, ``_events``). The core library never
imports this package; importing it imports no SDK.
"""
