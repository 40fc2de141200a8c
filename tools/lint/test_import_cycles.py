"""Self-test for import_cycles.py: fake crates with and without circles.

Run: python3 -m unittest discover -s tools/lint -p 'test_*.py'
"""

import contextlib
import io
import os
import subprocess
import sys
import tempfile
import textwrap
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import import_cycles  # noqa: E402

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "import_cycles.py")


def write_crate(root, name, files):
    for rel, text in files.items():
        path = os.path.join(root, "crates", name, "src", rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(textwrap.dedent(text))


CLEAN = {
    "lib.rs": """
        //! Root: re-exports and calls children, which is never an edge.
        pub mod a;
        pub mod b;
        pub mod net;
        pub use a::Alpha;
        pub fn f() { crate::b::beta(); self::net::tcp::go(); }
    """,
    "a.rs": """
        // use crate::b::Beta;  (a comment: no edge)
        use crate::{b::{Beta, beta}, net::tcp::Conn};
        const DOC: &str = "use crate::net::Net; super::b::x()";
        pub struct Alpha(Beta, Conn);
        #[cfg(test)]
        mod tests {
            use super::*;
            use crate::net::Net;
        }
    """,
    "b.rs": """
        pub struct Beta;
        pub fn beta() {}
        pub(crate) use crate::net::Net as N;
    """,
    "net/mod.rs": """
        pub mod tcp;
        pub struct Net;
        pub use self::tcp::Conn;
        fn g() { tcp::go(); crate::net::tcp::go(); }
    """,
    "net/tcp.rs": """
        use super::Net;  // child -> parent: counted, but no circle alone
        pub struct Conn(Net);
        pub fn go() {}
        mod inner {
            use super::Conn;     // this file (inner is inline)
            use super::super::Net;
        }
    """,
}

CIRCLE = {
    "lib.rs": "pub mod x; pub mod y; pub mod z; pub mod w;\n",
    "x.rs": """
        use crate::y::Y;
        pub struct X;
    """,
    "y.rs": """
        pub struct Y;
        fn f() -> super::z::Z { super::z::Z }
    """,
    "z.rs": """
        pub use crate::{
            w,
            x::{self, X},
        };
        pub struct Z;
    """,
    "w.rs": "pub struct W;\n",
}


def run_main(root):
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(io.StringIO()):
        rc = import_cycles.main(["--root", root])
    return rc, buf.getvalue()


class ImportCyclesTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.root = self.tmp.name

    def tearDown(self):
        self.tmp.cleanup()

    def test_clean_crate_has_no_circle(self):
        write_crate(self.root, "clean", CLEAN)
        rc, out = run_main(self.root)
        self.assertEqual(rc, 0, out)
        self.assertIn("import_cycles: 1 crates, 5 files, 0 circles", out)

    def test_clean_crate_edges(self):
        write_crate(self.root, "clean", CLEAN)
        files, edges, _ = import_cycles.analyze_crate(os.path.join(self.root, "crates/clean/src"))
        self.assertEqual(files, ["a.rs", "b.rs", "lib.rs", "net/mod.rs", "net/tcp.rs"])
        self.assertEqual(
            edges,
            {
                ("a.rs", "b.rs"): [3],
                ("a.rs", "net/tcp.rs"): [3],
                ("b.rs", "net/mod.rs"): [4],
                ("net/tcp.rs", "net/mod.rs"): [2, 7],
            },
        )

    def test_circle_is_found_with_lines(self):
        write_crate(self.root, "clean", CLEAN)
        write_crate(self.root, "loopy", CIRCLE)
        rc, out = run_main(self.root)
        self.assertEqual(rc, 1, out)
        self.assertIn("import_cycles: 2 crates, 10 files, 1 circle\n", out)
        self.assertIn(
            "circle in loopy: crates/loopy/src/x.rs, crates/loopy/src/y.rs, crates/loopy/src/z.rs",
            out,
        )
        self.assertIn("crates/loopy/src/x.rs:2: use crate::y::Y;", out)
        self.assertIn("crates/loopy/src/y.rs:3: fn f() -> super::z::Z { super::z::Z }", out)
        self.assertIn("crates/loopy/src/z.rs:4: x::{self, X},", out)
        self.assertNotIn("w.rs ->", out)

    def test_components(self):
        write_crate(self.root, "loopy", CIRCLE)
        files, edges, _ = import_cycles.analyze_crate(os.path.join(self.root, "crates/loopy/src"))
        comps = [c for c in import_cycles.strongly_connected(files, edges) if len(c) > 1]
        self.assertEqual(comps, [["x.rs", "y.rs", "z.rs"]])
        self.assertEqual(import_cycles.shortest_cycle(comps[0], edges),
                         ["x.rs", "y.rs", "z.rs", "x.rs"])

    def test_script_exit_codes(self):
        write_crate(self.root, "clean", CLEAN)
        ok = subprocess.run([sys.executable, SCRIPT, "--root", self.root],
                            capture_output=True, text=True)
        self.assertEqual(ok.returncode, 0, ok.stdout + ok.stderr)
        write_crate(self.root, "loopy", CIRCLE)
        bad = subprocess.run([sys.executable, SCRIPT, "--root", self.root],
                             capture_output=True, text=True)
        self.assertEqual(bad.returncode, 1, bad.stdout + bad.stderr)

    def test_strip_code_keeps_lines(self):
        src = 'let s = r#"a "quoted" // x"#; /* a /* nested */ b */ let c = \'"\'; // crate::x\n'
        out = import_cycles.strip_code(src + "fn f<'a>(x: &'a str) {}\n")
        self.assertEqual(out.count("\n"), 2)
        self.assertNotIn("crate", out)
        self.assertNotIn("quoted", out)
        self.assertIn("fn f<'a>(x: &'a str) {}", out)


if __name__ == "__main__":
    unittest.main()
