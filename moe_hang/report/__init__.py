"""Render a diagnosis for a person (rich, HTML) or a program (JSON). The only package that
imports rich."""
