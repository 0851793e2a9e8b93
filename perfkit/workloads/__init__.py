"""Synthetic requests (`requests`) and arrival processes (`arrivals`) for the runners."""
