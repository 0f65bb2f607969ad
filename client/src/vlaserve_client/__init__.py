"""The robot side of vlaserve: clients for the realtime and OpenPI websockets, and an executor that
runs action chunks at the control rate with real-time chunking (docs/client.md).

Imports numpy, msgpack and websockets only (never torch, never the server), so it installs on a
robot computer as its own distribution, vlaserve-client (`pip install ./client` from a checkout).
"""

from .aio import AsyncClient
from .executor import ActionChunkExecutor, ExecutorError, ExecutorEvent, ExecutorStats
from .protocol import (AuthenticationError, BatchError, ClientError, ConnectionLost, Reply, RtcNotSupported,
                       ServerError)
from .sync import Client

__all__ = ["ActionChunkExecutor", "AsyncClient", "AuthenticationError", "BatchError", "Client", "ClientError",
           "ConnectionLost", "ExecutorError", "ExecutorEvent", "ExecutorStats", "Reply", "RtcNotSupported",
           "ServerError"]
