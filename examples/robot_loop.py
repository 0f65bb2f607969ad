"""A robot control loop on vlaserve: actions at a fixed rate, the next chunk fetched in the background.

    vlaserve serve                                  # on the GPU box (no checkpoint: the demo model)
    python examples/robot_loop.py --url ws://GPU-BOX:8000 --hz 50 --horizon 25

Needs only numpy, msgpack and websockets on the robot (docs/client.md). Replace `Robot` with your
driver: `read_observation()` (cameras + joint state) and `command(action)`.
"""

from __future__ import annotations

import argparse
import logging
import time

import numpy as np

from vlaserve_client import ActionChunkExecutor, Client


class Robot:
    """A stand-in for a real arm: it "moves" to each commanded position at once."""

    def __init__(self, cameras: list[str], state_dim: int, action_dim: int):
        self.cameras, self.state_dim = cameras, state_dim
        self.position = np.zeros(action_dim, np.float32)
        self.frame = np.zeros((224, 224, 3), np.uint8)  # a camera buffer reused every frame

    def read_observation(self) -> dict:
        self.frame[:] = np.random.randint(0, 256, 3, dtype=np.uint8)  # "capture" into the same buffer
        return {"images": {cam: self.frame for cam in self.cameras},
                "state": self.position[: self.state_dim].copy(), "task": "pick up the red block"}

    def command(self, action: np.ndarray) -> None:
        self.position = action


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="ws://127.0.0.1:8000")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--hz", type=float, default=50.0, help="control rate")
    ap.add_argument("--horizon", type=int, default=None,
                    help="execution_horizon: ask for the next chunk when this many actions are left "
                         "(default: half a chunk); must exceed the round trip in ticks")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--no-rtc", action="store_true")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    client = Client(args.url, api_key=args.api_key, timeout=5.0)
    metadata = client.metadata()
    robot = Robot(metadata["cameras"], metadata["state_dim"], metadata["action_dim"])
    with ActionChunkExecutor(client, control_hz=args.hz, execution_horizon=args.horizon,
                             rtc=not args.no_rtc, on_underrun="repeat") as executor:
        executor.start(robot.read_observation())  # blocks once, for the first chunk
        period, next_tick = 1.0 / args.hz, time.perf_counter()
        for _ in range(int(args.seconds * args.hz)):
            # Pass the method, not its result: it is called (cameras read) only on ticks that send a request.
            robot.command(executor.get_action(robot.read_observation))
            next_tick += period
            time.sleep(max(0.0, next_tick - time.perf_counter()))
        stats = executor.stats
    print(f"{stats.ticks} ticks, {stats.chunks} chunks, RTC {'on' if stats.rtc_active else 'off'}, "
          f"delay {stats.inference_delay} ticks (round trip max {stats.max_round_trip_ms:.0f} ms), "
          f"starved ticks {stats.underrun_ticks}, late replies {stats.late_replies}")


if __name__ == "__main__":
    main()
