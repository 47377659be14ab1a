"""The tests, one room per package as the house is laid out (docs/layout.md), plus the house-wide checks and shared support."""
