"""``witness data include|exclude|find|check``: exact data inclusion and exclusion proofs, and which
documents and samples hold a text."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from ..errors import MalformedInput, VerificationError
from .args import DEFAULT_KEY, data_arg, one_line, positive, unusable_or_rejected
from .audit import read_head


def _write_proof(doc: dict, out: Path, subject: dict, key_path: str) -> None:
    from ..commit.dsse import envelope, statement
    from ..commit.hashing import canonical_json
    from ..commit.signing import load_or_create_key

    out.write_bytes(canonical_json(doc) + b"\n")
    stmt = statement([subject], f"data-{doc['kind']}/v1", doc)
    env_path = out.with_name(out.name + ".dsse.json")
    env_path.write_bytes(canonical_json(envelope(stmt, load_or_create_key(Path(key_path)))) + b"\n")
    print(f"wrote {out} ({out.stat().st_size} bytes) and {env_path}")


def cmd_data(args: argparse.Namespace) -> int:
    """Data inclusion and exclusion proofs."""
    from ..data.proofs import prove_exclusion, prove_inclusion
    from ..verify.data_queries import check_data_proof, query_document, run_commitments

    if args.data_command == "check":
        return _check_data_proof(args, check_data_proof)
    notes: list[str] = []
    run, task = run_commitments(args.bundle, notes)
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    if args.data_command in ("find", "search"):
        return _search(args, run)
    _out_is_no_input(Path(args.out), args.file, args.bundle)
    try:
        document = query_document(run.dataset, args.file, args.text)
    except ValueError as e:  # e.g. a text file of odd length on a dataset of 2-byte tokens
        hint = _kind_hint(run.dataset, args)
        if hint is None:
            raise
        print(f"error: {one_line(str(e))}\n{hint}", file=sys.stderr)  # the hint in full (main cuts an error)
        return 2
    if args.data_command == "include":
        if document not in run.usage.documents:
            print(f"document {document.hex()} was never used by this run (try: witness data exclude)", file=sys.stderr)
            _print_hint(_kind_hint(run.dataset, args))
            return 1
        doc = prove_inclusion(run, document)
        print(f"document {document.hex()} was used in {len(doc['uses'])} step(s)")
    else:
        if document in run.usage.documents:
            print(f"document {document.hex()} WAS used by this run (try: witness data include)", file=sys.stderr)
            return 1
        from ..verify.data_queries import known_document

        known = known_document(run, document)
        doc = prove_exclusion(run, document, bytes_only=not known)  # the caveat goes into the proof itself
        print(f"document {document.hex()} was never used by this run")
    _write_proof(doc, Path(args.out), released_model(args.bundle, args.model, Path(args.out)), args.key)
    if args.data_command == "exclude":
        if not known:
            print("note (written into the proof as its scope): no document of the run's dataset has exactly these bytes, so this proves only that the run "
                  "never trained on a document with exactly these bytes; a fragment of a used document, or a window "
                  "shifted against the dataset's, is not covered: `witness data find` finds the documents and "
                  "samples that contain a text", file=sys.stderr)
            _print_hint(_kind_hint(run.dataset, args))  # a document of the dataset fits its kind: no hint then
    return 0


def _kind_hint(dataset, args: argparse.Namespace) -> str | None:  # noqa: ANN001 - a Dataset
    """The hint for a query input that plainly does not fit the dataset's kind (``data.hints``), or None.

    Asked only where the answer is "never used", "nothing found" or an error, and printed beside
    it: the answer for the bytes given always stands, so a hint can neither turn "never used"
    into "used" nor hide an answer."""
    from ..data.hints import PEEK_BYTES, file_hint, text_hint

    if args.file is None:
        # a text searched for may lie in a tensor sample's bytes (its header's names): only a
        # document query (include, exclude) can plainly not fit
        return None if args.data_command in ("find", "search") else text_hint(dataset)
    try:
        peek = read_bounded(args.file, PEEK_BYTES, "--file", cut=True)
    except OSError:  # the answer was given for the file already; no hint is lost for an unreadable one
        return None
    return file_hint(dataset, args.file, peek)


def _print_hint(hint: str | None) -> None:
    if hint is not None:
        print(hint, file=sys.stderr)


def _out_is_no_input(out: Path, file: str | None, bundle: str) -> None:
    """``--out`` (and the envelope written beside it) may name neither the queried document nor a
    file of the bundle: a proof never replaces what it is about."""
    targets = [out, out.with_name(out.name + ".dsse.json")]
    inputs = [Path(file)] if file else []
    for t in targets:
        if t.exists() and any(i.exists() and os.path.samefile(t, i) for i in inputs):
            raise ValueError(f"--out {out} would replace the document it is about ({file}): name another file")
        if Path(bundle).resolve() in t.resolve().parents:
            raise ValueError(f"--out {out} lies inside the bundle {bundle}: name a file outside it")


def _search(args: argparse.Namespace, run) -> int:  # noqa: ANN001 - RunCommitments
    """``witness data find``: which documents and samples contain a text, and whether the run used them."""
    from ..verify.data_queries import search_text

    needle = read_bounded(args.file, MAX_SEARCH_BYTES, "--file") if args.file is not None \
        else run.dataset.text_bytes(args.text)
    found = used_first(search_text(run, needle, sys.maxsize), args.limit)
    if args.json:
        print(json.dumps(found))
    else:
        unit = run.dataset.unit
        what = f"{found['needle_bytes'] // unit} token(s)" if unit > 1 else f"{found['needle_bytes']} byte(s)"
        print(f"{found['documents_found']} document(s) of the run's dataset contain the {what}, "
              f"{found['documents_used']} of them used in training; {found['samples_found']} sample(s), "
              f"{found['samples_used']} of them trained on")
        if getattr(run.dataset, "stride", None):  # windows: a text across two windows lies in neither
            print("  (the samples are windows of the token file: a text that straddles two of them is in neither)")
        for d in found["documents"]:
            print(f"  {'USED  ' if d['used'] else 'unused'} {d['document']} ({d['hash'][:16]}…)")
        if found["documents_found"] > len(found["documents"]):
            hidden_used = found["documents_used"] - sum(d["used"] for d in found["documents"])
            print(f"  … and {found['documents_found'] - len(found['documents'])} more, {hidden_used} of them used "
                  "(--limit)")
    if not found["documents_found"] and not found["samples_found"]:
        _print_hint(_kind_hint(run.dataset, args))  # nothing found: a text given as token ids, say
    return 0 if found["samples_used"] or found["documents_used"] else 1


def used_first(found: dict, limit: int) -> dict:
    """``search_text``'s answer with its documents and samples listed used ones first (each group
    in dataset order), then cut to ``limit``: a limit never hides a used one behind unused ones."""
    out = dict(found)
    for key in ("documents", "samples"):
        out[key] = sorted(found[key], key=lambda item: not item["used"])[:limit]  # a stable sort
    return out


MAX_SEARCH_BYTES = 1 << 20  # a text to look for: a passage, not a corpus


def read_bounded(path: str, limit: int, what: str, cut: bool = False) -> bytes:
    """A file's bytes, at most ``limit`` of them (a device or a huge file is refused, not read whole;
    with ``cut``, its first ``limit`` bytes are enough)."""
    with open(path, "rb") as f:
        data = f.read(limit if cut else limit + 1)
    if len(data) > limit:
        raise ValueError(f"{what} {path}: over {limit} bytes; a text to look for is at most {limit} bytes")
    return data


def released_model(bundle_dir: str, model: str | None, out: Path) -> dict:
    """The in-toto subject of a statement about a run: its released model file, written if missing."""
    from ..bundle.reader import open_bundle
    from ..evals.release import release_file

    path = Path(model) if model else out.with_name("model.safetensors")
    subject = release_file(open_bundle(bundle_dir), path)
    print(f"subject: {path} (SHA-256 {subject['digest']['sha256']}), the run's final model as released")
    return subject


def _check_data_proof(args: argparse.Namespace, check_proof) -> int:
    """``witness data check``: as ``witness verify`` reports a verdict, a ``VALID: …`` line on
    stdout, then the summary as JSON (whole, after that one line; ``--json``: the JSON alone), exit
    0; or an ``INVALID: …`` (exit 1) or ``UNUSABLE INPUT: …`` (exit 2) line on stderr. A signer
    nothing pins gets a ``WARNING: …`` line on stderr."""
    from ..bundle.reader import open_bundle
    from ..commit.dsse import read_json_or_envelope, read_signed
    from ..commit.signing import read_public_key
    from ..data.proofs import MAX_PROOF_BYTES

    head, key, digest, task, usage, b = None, None, None, None, [], None
    try:
        pinned = read_public_key(args.signer) if args.signer else None
        if args.bundle:
            from ..verify.cheap import task_of

            b = open_bundle(args.bundle)
            head, key, digest, task = b.final_head, b.manifest.public_key, b.manifest.state_digest, task_of(b)
            if b.end is None:
                raise MalformedInput("the bundle is not a finished run: no end record commits its used data")
        elif args.tree_head:
            head = read_head(args.tree_head)
            pinned_head = read_json_or_envelope(args.tree_head, 1 << 20, "tree-head")
            key = pinned_head.get("public_key") if isinstance(pinned_head, dict) else None
        # the run's key (the bundle's, or the published head's) is one the verifier already trusts
        obj, signed = read_signed(args.proof, MAX_PROOF_BYTES, "proof", pinned=pinned,
                                  trusted=[key] if isinstance(key, str) else [])
        if b is not None and b.leaves is not None:  # the used-data trees the proof relies on, rebuilt from the leaves
            from ..verify.usage import check_data_usage, committed_leaves

            usage = check_data_usage(b, task, committed_leaves(b, task))
        summary = check_proof(obj, head=head, public_key=key, task=task)
        # a bare proof's signature is its own head's, by the key it names (check_proof verified it)
        signer = signed.signer if signed else obj["public_key"]
        if pinned is not None and signer != pinned:
            raise VerificationError(f"the proof is signed by key {signer}, not by the expected key {pinned} "
                                    "(--signer)", check="signature")
        pinned_by = "--signer" if pinned else "the run's key" if signer == key else None
        summary |= {"signer_key": signer, "signer_pinned": pinned_by is not None}
        if usage:
            summary["used_data"] = usage
        if args.model:
            from ..commit.hashing import parse_hex
            from ..evals.release import check_subject

            final = parse_hex(obj["tree_head"]["extensions"].get("final_model_hash"), "final_model_hash")
            weights = check_subject(signed.statement if signed else None, args.model, final, digest)
            if b is not None:  # with the run at hand, its task says which names are one tensor (tied weights)
                from ..evals.release import check_tied

                check_tied(b, weights, Path(args.model).name)
            summary["subject"] = f"{Path(args.model).name}: the run's final model, named by the statement"
    except VerificationError as e:
        if args.json:  # a script reading stdout gets an answer either way, as from witness verify --json
            print(json.dumps({"valid": False, "failures": [str(e)]}))
        # what is wrong, naming the proof; unusable input keeps the line every command prints for it
        line = unusable_or_rejected(e) if isinstance(e, MalformedInput) else f"INVALID: {args.proof}: {e}"
        print(one_line(line, None), file=sys.stderr)
        return e.exit_code
    if head is None:
        summary["note"] = "checked against the proof's own signed head; pin one with --bundle or --tree-head"
    what = "the envelope" if signed else "the proof"
    if args.json:
        print(json.dumps({"valid": True} | summary))
    else:
        print(_valid_line(args, summary, head, key) + f"; {what} is signed by key {signer} "
              f"({f'pinned by {pinned_by}' if pinned_by else 'which nothing pins'})")
        print(json.dumps(summary, indent=2))
    if pinned_by is None:
        print(unpinned_warning(what, signer, "the run's key" if key else None,
                               "" if args.bundle else ", or check it against its run with --bundle"), file=sys.stderr)
    return 0


def unpinned_warning(what: str, signer: str, trusted: str | None, hint: str = "") -> str:
    """The line that says a signature by ``signer`` proves nothing about who made ``what``."""
    why = f"it is not {trusted}, and no --signer pins it" if trusted else "no --signer pins it"
    return (f"WARNING: {what} is signed by key {signer}, which nothing pins ({why}): the signature proves nothing "
            f"about who made it; pass --signer with the key you trust{hint}")


def _valid_line(args: argparse.Namespace, summary: dict, head, key: str | None) -> str:  # noqa: ANN001 - a head
    """The one line that says what a valid proof shows and what it was checked against."""
    steps = summary.get("steps", [])
    shown = ", ".join(map(str, steps)) if len(steps) <= 8 else f"{', '.join(map(str, steps[:6]))}, …, {steps[-1]}"
    claim = (f"document {summary['document']} was used by the run, in {len(steps)} step(s) ({shown})"
             if summary["kind"] == "inclusion" else f"document {summary['document']} was never used by the run")
    if args.bundle:
        pin = f"against the final signed head of the bundle {args.bundle} and its key"
        if summary.get("used_data"):
            pin += ", with the used-data trees rebuilt from its leaves"
    elif head is not None:
        pin = f"against the published tree head {args.tree_head}" + \
              (" and its key" if key else " (which names no key: the proof's own key signed it)")
    else:
        pin = "against the proof's own signed head and key only (pin one with --bundle or --tree-head)"
    task = f"task {summary['task']}, " if summary.get("task") else ""
    model = f"; the statement names the released model {Path(args.model).name}" if args.model else ""
    return (f"VALID: {summary['kind']} proof: {claim} ({task}document rule {summary['document_rule']}, signed by "
            f"{summary['signer']}), checked {pin}{model}")


def cmd_commit(args: argparse.Namespace) -> int:
    """Commit a token corpus: its root, and the leaves file that publishes its per-sample commitments."""
    import time

    from ..data.tokens import TokenCorpus, shard_format, shard_paths

    out = Path(args.out)
    for shard in shard_paths(args.source):  # --force replaces the leaves file, never the data
        if out.resolve() == shard.resolve() or (out.exists() and os.path.samefile(out, shard)):
            raise ValueError(f"--out {out} is one of the shards being committed ({shard}): name another file")
    corpus = TokenCorpus(args.source, args.block, eot=args.eot, fmt=args.format)
    if out.exists() and not args.force:
        raise ValueError(f"{out} exists (pass --force to replace it)")
    started = time.perf_counter()
    root = corpus.commit(out, progress=True)
    took = time.perf_counter() - started
    print(json.dumps({"root": root.hex(), "samples": len(corpus), "tokens": corpus.tokens_total,
                      "shards": len(shard_paths(args.source)), "block": args.block, "token_bytes": corpus.width,
                      "format": sorted({shard_format(x) for x in corpus.shards}),
                      "leaves": str(out), "leaves_bytes": out.stat().st_size, "seconds": round(took, 3)}, indent=2))
    return 0


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Add this group's subcommands."""
    dq = sub.add_parser("data", help="exact data inclusion and exclusion proofs, and corpus commitments")
    dsub = dq.add_subparsers(dest="data_command", required=True)
    cm = dsub.add_parser("commit", help="commit a token corpus (llm.c shards or nanoGPT .bin files): its root "
                                        "and the leaves file a verifier checks every batch against")
    cm.add_argument("source", help="a shard, or a directory of .bin shards (read in name order as one stream)")
    cm.add_argument("--block", type=positive, required=True, help="tokens per window (a sample is block + 1 tokens)")
    cm.add_argument("--eot", type=int, default=50256, help="the end-of-text token that separates documents "
                                                           "(default: GPT-2's 50256)")
    cm.add_argument("--format", choices=["auto", "llmc", "u16", "u32"], default="auto",
                    help="llmc: a 256-int32 header (magic 20240520 or 20240801); u16: nanoGPT's headerless "
                         "uint16; auto (default): llmc where the header fits, else u16")
    cm.add_argument("--out", required=True, help="the leaves file to write")
    cm.add_argument("--force", action="store_true", help="replace --out if it exists")
    cm.set_defaults(func=cmd_commit)
    for name, what in (("include", "prove a document was used (exit 1 if it was not)"),
                       ("exclude", "prove a document was never used (exit 1 if it was)")):
        q = dsub.add_parser(name, help=what)
        q.add_argument("bundle", help="the bundle of the run")
        g = q.add_mutually_exclusive_group(required=True)
        g.add_argument("--file", help="the document, as a file")
        g.add_argument("--text", help="the document, as text")
        q.add_argument("--out", required=True, help="the proof file to write (a DSSE envelope goes beside it)")
        q.add_argument("--key", default=str(DEFAULT_KEY), help="key that signs the DSSE envelope")
        q.add_argument("--model", help="the released model file the statement names (default: model.safetensors "
                                        "beside --out, written from the run's final checkpoint if missing)")
        data_arg(q)
        q.set_defaults(func=cmd_data)
    se = dsub.add_parser("find", aliases=["search"], help="which documents and samples of the run's dataset contain a text, and "
                                        "whether the run trained on them (exit 0 if it did, 1 if not)")
    se.add_argument("bundle", help="the bundle of the run (the dataset must be on this machine)")
    g = se.add_mutually_exclusive_group(required=True)
    g.add_argument("--text", help="the text to look for (its UTF-8 bytes)")
    g.add_argument("--file", help="a file holding the bytes to look for")
    se.add_argument("--limit", type=positive, default=100, help="most documents and samples listed, used ones first "
                                                                 "(default 100)")
    se.add_argument("--json", action="store_true", help="print the answer as one JSON object")
    data_arg(se)
    se.set_defaults(func=cmd_data)
    c = dsub.add_parser("check", help="check a proof against the public commitments: a VALID line, then the "
                                     "summary as JSON (0 valid, 1 invalid, 2 unusable)")
    c.add_argument("proof", help="the proof (JSON or its DSSE envelope)")
    g = c.add_mutually_exclusive_group()
    g.add_argument("--bundle", help="check against this bundle's signed head and key")
    g.add_argument("--tree-head", help="a published signed tree head (JSON, with public_key)")
    c.add_argument("--model", help="also check that the signed envelope names this released model file")
    c.add_argument("--signer", help="the key that must have signed the envelope (or a bare proof): raw hex or PEM, "
                                    "or a file holding either; without it, or the run's key by --bundle or "
                                    "--tree-head, a signer is reported with a WARNING that nothing pins it")
    c.add_argument("--json", action="store_true", help="print the answer as one JSON object alone (no VALID "
                                                       "line; {\"valid\": false, ...} when it is not)")
    c.set_defaults(func=cmd_data)
