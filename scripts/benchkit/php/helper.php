<?php

/**
 * scripts/bench, in its scratch copy of Phorge: `php helper.php PHORGE_ROOT DOCUMENTS`
 * makes (or finds) the administrator bot with a Conduit token and DOCUMENTS - 1 users,
 * whose PHIDs the search tasks re-index; prints them as JSON, and whether Phorge's
 * loader finds the bench's no-op class.
 */
require_once $argv[1].'/scripts/init/init-script.php';
require_once dirname(dirname(dirname(__FILE__))).'/phorge_accounts.php';

$viewer = PhabricatorUser::getOmnipotentUser();
$bot = phorge_bridge_account($viewer, 'bridgebenchbot', true, true);
$documents = array($bot->getPHID());
for ($n = 1; $n < max(1, (int)$argv[2]); $n++) {
  $documents[] = phorge_bridge_account($viewer, sprintf('bridgebench%02d', $n))->getPHID();
}
$noop = 'PhorgeBridgeBenchNoopWorker';
echo json_encode(array(
  'token' => phorge_bridge_api_token($viewer, $bot),
  'admin' => (bool)$bot->getIsAdmin(),
  'documents' => $documents,
  'noopLoaded' => class_exists($noop) && is_subclass_of($noop, 'PhabricatorWorker'),
  'php' => PHP_VERSION,
));
