"""The names llmserver's HTTP server (`http_protocol`) offers its app beyond plain ASGI: the whole
interface between the two. The app imports these names, never the server's classes; under another
ASGI server none of the three is there and the app does without (it checks).

- `CANCEL_ON_DISCONNECT`, a scope key the server sets False. While the app sets it True, losing the
  connection cancels the request's task and sets the key to `CANCELLED` (work that is useless without
  its client, a non-streamed generation, ends at once with no task of the app's watching).
- `DIRECT_WRITE`, in `scope["extensions"]`: a callable the app may call with the server's own `send`
  (the one it was called with) once it has started a chunked answer through it (no Content-Length: an
  event stream). It returns a `Writer`, or None when the answer is not one it can write. A `Writer`
  takes a body chunk, writes it framed straight to the connection from any callback (no task woken
  per token), and returns False once the client is gone (nothing written) or the connection's buffer
  is full (what it was given is written all the same): from then on the app sends through `send`,
  which waits. The answer still ends through `send`.
- `HEADER_INDEX`, a scope key: `(scope["headers"], {name: first value})`, the request's headers by
  name, made once. The server sets it with the scope; where it is absent, or made for another
  headers list, the app makes it (`api/deps.scope_header`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

CANCEL_ON_DISCONNECT = "llmserver.cancel_on_disconnect"
CANCELLED = "cancelled"
DIRECT_WRITE = "llmserver.direct_write"
HEADER_INDEX = "llmserver.header_index"

Writer = Callable[[bytes], bool]
OpenWriter = Callable[[Any], Writer | None]  # the server's `send` → its writer, if it has one
