use model::*;
fn main() {
    let args: Vec<String> = std::env::args().collect();
    let m = Model::load(&args[1]).unwrap();
    let toks: Vec<u32> = args[2].split(',').map(|s| s.parse().unwrap()).collect();
    let cx = Compute::new(2);
    let mut kv = KvCache::new(m.kv_layout(KvType::F32, 0..=m.n_layer() - 1, 512));
    let src = ResidentExperts::new(&m);
    let mut input = toks.clone();
    let t0 = std::time::Instant::now();
    for step in 0..8 {
        let n = input.len();
        let mut seqs = [SeqInput {
            kv: &mut kv,
            n_tokens: n,
            logits: LogitsWanted::Last,
        }];
        let out = m
            .forward(
                &cx,
                &src,
                0..=m.n_layer() - 1,
                true,
                StageInput::Tokens(&input),
                &mut seqs,
                &mut NoHooks,
            )
            .unwrap();
        let StageOutput::Logits(l) = out else {
            panic!()
        };
        let row = l.row(0);
        let (best, _) = row
            .iter()
            .enumerate()
            .fold((0, f32::MIN), |a, (i, &v)| if v > a.1 { (i, v) } else { a });
        println!(
            "step {step}: token {best} logit {:.4} ({:?})",
            row[best],
            t0.elapsed()
        );
        input = vec![best as u32];
    }
}
