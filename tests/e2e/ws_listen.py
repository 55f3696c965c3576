"""Record a ComfyUI websocket's messages to a file, one JSON line each (binary frames as their type and size, and
the text of text-on-node frames).

Run with ComfyUI's own Python (it has aiohttp): `python ws_listen.py ws://host:port/ws?clientId=ID OUT_FILE`.
The end-to-end tests start it in the background and stop it when done.
"""

import asyncio
import json
import sys

import aiohttp


TEXT_EVENT = 3  # ComfyUI's BinaryEventTypes.TEXT: text shown on a node (send_progress_text)


def binary_record(data: bytes) -> dict:
    """A binary frame: its event type and size; for a text event also its node id and text (the payload is a 4-byte
    node-id length, the node id, then the UTF-8 text)."""
    event = int.from_bytes(data[:4], "big")
    record = {"type": "binary", "event": event, "bytes": len(data)}
    if event == TEXT_EVENT:
        length = int.from_bytes(data[4:8], "big")
        record["node"] = data[8:8 + length].decode("utf-8")
        record["text"] = data[8 + length:].decode("utf-8")
    return record


async def listen(url: str, out_path: str) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.ws_connect(url) as ws:
            with open(out_path, "w") as out:
                out.write(json.dumps({"type": "connected"}) + "\n")
                out.flush()
                async for message in ws:
                    if message.type == aiohttp.WSMsgType.TEXT:
                        out.write(message.data.strip() + "\n")
                    elif message.type == aiohttp.WSMsgType.BINARY:
                        out.write(json.dumps(binary_record(message.data)) + "\n")
                    out.flush()


if __name__ == "__main__":
    asyncio.run(listen(sys.argv[1], sys.argv[2]))
