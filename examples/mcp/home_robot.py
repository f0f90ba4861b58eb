"""A home robot's actions as an MCP server, written with the official ``mcp`` SDK.

What a robot program exposes to Magnitude's agent without wrapping anything as a python tool: the
agent's tool service starts it (stdio) or reaches it (streamable HTTP). The readings are fixed tables,
so ``scripts/bench/agent/`` can check the answers and the tests can assert them.

    python examples/mcp/home_robot.py                              # stdio (the tool service starts it)
    python examples/mcp/home_robot.py --http 8765                  # streamable HTTP on 127.0.0.1:8765/mcp
    MCP_KEY=secret python examples/mcp/home_robot.py --http 8765 --host 0.0.0.0   # any other host needs a key
"""

from __future__ import annotations

import argparse
import hmac
import os
import sys
from typing import Literal

from mcp.server.mcpserver import MCPServer

Room = Literal["kitchen", "living_room", "bedroom", "bathroom", "garage", "laundry", "hall"]
Sensor = Literal["temperature", "humidity", "co2"]

#: Metres from the charging dock, and the battery (percent) on arrival.
TRIPS = {"kitchen": (12, 91), "living_room": (9, 92), "bedroom": (21, 88), "bathroom": (17, 89),
         "garage": (38, 79), "laundry": (26, 76), "hall": (5, 93)}
READINGS = {"temperature": {"kitchen": 21.5, "living_room": 22.0, "bedroom": 19.0, "bathroom": 23.5,
                            "garage": 11.5, "laundry": 20.5, "hall": 18.0},
            "humidity": {"kitchen": 48, "living_room": 41, "bedroom": 45, "bathroom": 64, "garage": 70,
                         "laundry": 58, "hall": 43},
            "co2": {"kitchen": 640, "living_room": 720, "bedroom": 812, "bathroom": 530, "garage": 450,
                    "laundry": 500, "hall": 480}}
UNITS = {"temperature": "degrees Celsius", "humidity": "% relative humidity", "co2": "ppm"}
DOORS = {"front": "locked", "back": "unlocked", "garage": "open"}

mcp = MCPServer("home-robot", instructions="A home robot: drive it to rooms, read its room sensors and doors.")


@mcp.tool()
def move_to(room: Room) -> str:
    """Drive the robot from its dock to a room. Returns the distance driven and the battery on arrival."""
    metres, battery = TRIPS[room]
    return f"Arrived in the {room.replace('_', ' ')} after driving {metres} m. Battery: {battery}%."


@mcp.tool()
def read_sensor(room: Room, sensor: Sensor) -> str:
    """Read a room's sensor now: temperature, humidity or co2 (carbon dioxide)."""
    return f"{sensor} in the {room.replace('_', ' ')}: {READINGS[sensor][room]} {UNITS[sensor]}"


@mcp.tool()
def door_state(door: Literal["front", "back", "garage"]) -> str:
    """Whether a door of the house is locked, unlocked or open."""
    return f"The {door} door is {DOORS[door]}."


@mcp.tool()
def robot_status() -> str:
    """The robot's own state at its dock: battery level and what it is doing."""
    return "Docked and charging. Battery: 97%. Wheels: ok."


def keyed(app, key: str):
    """The HTTP app, answering 401 to any request without ``Authorization: Bearer KEY``."""
    expected = f"Bearer {key}".encode()

    async def guarded(scope, receive, send):
        if scope["type"] == "http":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, expected):
                await send({"type": "http.response.start", "status": 401,
                            "headers": [(b"content-type", b"text/plain")]})
                await send({"type": "http.response.body", "body": b"a key is needed: Authorization: Bearer KEY"})
                return
        await app(scope, receive, send)
    return guarded


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--http", type=int, metavar="PORT", help="serve streamable HTTP on this port (else stdio)")
    parser.add_argument("--host", default="127.0.0.1", help="HTTP address (anything but loopback needs MCP_KEY)")
    args = parser.parse_args()
    if args.http is None:
        mcp.run("stdio")
        return 0
    import uvicorn
    from mcp.server.transport_security import TransportSecuritySettings

    key = os.environ.get("MCP_KEY")
    if args.host not in ("127.0.0.1", "localhost", "::1") and not key:
        print("refusing to serve beyond loopback without MCP_KEY", file=sys.stderr)
        return 2
    # On loopback the SDK checks Host and Origin (DNS rebinding); behind compose the Host header is the
    # service's name, so there the key guards the server instead.
    app = mcp.streamable_http_app(host=args.host, transport_security=TransportSecuritySettings(
        enable_dns_rebinding_protection=False) if key else None)
    uvicorn.run(keyed(app, key) if key else app, host=args.host, port=args.http, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
