"""The name README gives the send-lifetime checker; it lives in :mod:`paddle_hybrid.send_wait.lifetimes`."""
from .send_wait.lifetimes import SendLifetimeError, check_send_lifetimes

__all__ = ["SendLifetimeError", "check_send_lifetimes"]
