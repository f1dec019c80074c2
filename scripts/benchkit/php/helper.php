<?php

/**
 * phorge-bridge's scripts/bench, inside its scratch copy of Phorge:
 *
 *   php helper.php PHORGE_ROOT setup DOCUMENTS
 *
 * makes (or finds) the bench's administrator bot with a Conduit API token, and
 * DOCUMENTS - 1 more users whose PHIDs, with the bot's, are the documents the
 * PhabricatorSearchWorker tasks re-index; then says whether Phorge's loader
 * finds the bench's no-op class. Prints one JSON object.
 */
$root = $argv[1];
require_once $root.'/scripts/init/init-script.php';
require_once dirname(dirname(dirname(__FILE__))).'/phorge_accounts.php';

const BENCH_NOOP_CLASS = 'PhorgeBridgeBenchNoopWorker';

$viewer = PhabricatorUser::getOmnipotentUser();
switch ($argv[2]) {
  case 'setup':
    $count = max(1, (int)$argv[3]);
    $bot = phorge_bridge_account($viewer, 'bridgebenchbot', true, true);
    $documents = array($bot->getPHID());
    for ($n = 1; $n < $count; $n++) {
      $user = phorge_bridge_account($viewer, sprintf('bridgebench%02d', $n));
      $documents[] = $user->getPHID();
    }
    echo json_encode(array(
      'token' => phorge_bridge_api_token($viewer, $bot),
      'botPHID' => $bot->getPHID(),
      'admin' => (bool)$bot->getIsAdmin(),
      'documents' => $documents,
      'noopLoaded' => class_exists(BENCH_NOOP_CLASS)
        && is_subclass_of(BENCH_NOOP_CLASS, 'PhabricatorWorker'),
      'php' => PHP_VERSION,
    ));
    break;
  default:
    fwrite(STDERR, "usage: helper.php PHORGE_ROOT setup DOCUMENTS\n");
    exit(2);
}
