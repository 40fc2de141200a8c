use model::*;
struct Rec(Vec<(Option<usize>, &'static str, Vec<f32>)>);
impl Hooks for Rec {
    fn observe(&mut self, l: Option<usize>, n: &'static str, d: &[f32]) {
        self.0.push((l, n, d.to_vec()));
    }
}
fn run(path: &str, toks: &[u32]) -> Rec {
    let m = Model::load(path).unwrap();
    let cx = Compute::new(2);
    let mut kv = KvCache::new(m.kv_layout(KvType::F32, 0..=m.n_layer() - 1, 512));
    let src = ResidentExperts::new(&m);
    let mut rec = Rec(vec![]);
    let mut seqs = [SeqInput {
        kv: &mut kv,
        n_tokens: toks.len(),
        logits: LogitsWanted::Last,
    }];
    m.forward(
        &cx,
        &src,
        0..=m.n_layer() - 1,
        true,
        StageInput::Tokens(toks),
        &mut seqs,
        &mut rec,
    )
    .unwrap();
    rec
}
fn main() {
    let a: Vec<String> = std::env::args().collect();
    let toks = [504u32, 3575, 282, 4521, 314];
    let (x, y) = (run(&a[1], &toks), run(&a[2], &toks));
    for (l, n, d1) in x.0.iter() {
        let Some((_, _, d2)) = y.0.iter().find(|(l2, n2, _)| l2 == l && n2 == n) else {
            continue;
        };
        let md = d1
            .iter()
            .zip(d2)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        let mx = d1.iter().map(|a| a.abs()).fold(0f32, f32::max);
        if (*n == "ffn_out" || *n == "l_out") && (l.unwrap_or(0) < 3 || l.unwrap_or(0) > 27)
            || l.is_none()
        {
            println!("{l:?} {n}: max diff {md:e} (max {mx})");
        }
    }
}
